"""When does drafting pay? A cost model from measured step times and per-request acceptance.

A request that drafts gains `a` tokens per step (its running acceptance length: accepted drafts
+ the bonus token) in a step that costs t_spec (draft + verify); without drafts it gains 1 token
in a step that costs t_plain. Drafting pays while

    speedup = a * t_plain / t_spec > 1.

Upstream measured (issue #54691) that the break-even `a` rises with context and batch size, so
the times are kept per (batch-size bucket, context bucket) as the lower quartile of the bucket's
last `time_window` steps measured on the host (the engine's wall clock around a step; no device
syncs). Step-time noise is one-sided: a step can pay a one-time cost (a first plan at a new size,
a graph's first launch, a Python GC pass, the host descheduled) but never runs faster than its
work. A mean or even a median of the few plain samples that exploration takes can therefore hold
such a cost, and with it an engine that drafts where drafting cannot pay: on the H200 a plain
bucket held 5.05 ms against the 1.0-1.2 ms of steady plain steps (sixth session), and an engine
with drafting that could not pay drafted all 77 of its steps (seventh; docs/performance.md).
The lower quartile is the minimum while a bucket holds <= 4 timings, so one good sample
corrects a bad start; with 8 it ignores one freak-fast sample too.

These rules keep the decisions stable and the model fed:
* hysteresis: a drafting request stops below 1 - h, an idle one restarts above 1 + h;
* re-probe: every `probe_interval` steps, requests that stopped draft for `probe_len` steps (all
  together, so the probe steps are pure draft+verify steps that refresh t_spec too); their
  acceptance restarts from what the probe measures (a request keeps drafting until it has
  `min_acceptance_samples` of them). A probe that revives nobody doubles the
  interval (up to `max_probe_interval`). And probes are paid for from a budget: a probe's
  probe_len + min_acceptance_samples - 1 speculative steps each cost (t_spec / t_plain - 1)
  plain steps more than the plain steps they replace; every step adds `probe_budget` plain
  steps of credit, and a probe starts only when the credit covers it, which holds probing
  where drafting cannot pay to ~probe_budget of the decode time. The start is charged an
  estimate; once the probe's steps and the plain step after it are timed, the credit is
  charged what they measured instead (observe_probe_step): on the H200 a probe's first steps
  cost 3-7 ms against ~2 ms for a steady speculative step and 0.7 ms plain (they run
  synchronously and re-plan; tiny model, B=8, twelfth session), so the estimate put probing
  at 5-7 % of the decode time, not 2 %. (On the tiny model at B=8 a
  speculative step costs ~4 plain ones: 3 probes in 256 steps, every 32 doubling, cost it
  25-30 % against no speculation, eighth session; the budget spaces them ~450 steps apart
  there.) The credit starts full and is held to one probe: a request judged on its first
  verify steps, right after its prompt, where drafts can be much worse than later on (the
  tiny DSpark drafter accepted 1.3 tokens per step there and 3.0 over 256 tokens, on the
  CPU, tenth session), gets its second look at the next probe interval, not a budget's
  worth of steps later;
* judging: a request is judged once it has `min_acceptance_samples` acceptance samples
  (averaged evenly up to 1/acceptance_alpha samples, then exponentially), and a drafting
  request stops only when its estimate plus `stop_confidence` standard errors would not pay:
  a verify step gains anything from 1 to k+1 tokens, and with a mean of 3 a run of 1s and 2s
  is common (the estimate restarts drafting on its own);
* exploration: until some bucket has both timings, a bucket with too few spec-step timings
  drafts and one with too few plain-step timings then runs max(`min_samples`, `plain_run_len`)
  plain steps; later, a bucket without both borrows the cost ratio of its nearest measured
  neighbour;
* plain re-probe: while everyone drafts, no plain step is timed, so a t_plain that exploration
  measured too high (a step that paid a one-time cost) would keep drafting on forever. Every
  `probe_interval` steps of all-drafting the batch runs `plain_run_len` plain steps; the
  interval doubles (up to `max_probe_interval`) while the cost ratio stays within the
  hysteresis band;
* settled: once a step has stopped every request for cost, the next steps with the same
  requests (in the same order), no probe due, the same acceptance override and a cost ratio
  that still keeps the best of their acceptances below the restart threshold decide the same
  without the per-request loop (acceptances cannot move while nobody drafts; any acceptance
  sample or departure clears it). This is the state the engine sits in where drafting cannot
  pay, so its host cost is the policy's overhead against no speculation; for the same reason
  only one settled step in `settled_timing_interval` is timed (wants_step_timed).

Plain steps are measured in runs of `plain_run_len` because the first plain step after a
verify step is not what a plain step costs in plain decoding: under async scheduling it runs
synchronously (nothing is in flight to overlap with) and it pays the switch. On the H200 (tiny
model, B=1, ninth session) it took 1.7 ms against 0.66 ms for the overlapped plain steps that
follow. There the two exploration steps paid one-time costs (10.3 and 24.8 ms) and a one-step
plain re-probe measured 1.9 ms, against a t_spec of 1.93 ms: a ratio of 1.015, inside the
hysteresis band, so an engine whose drafts could not pay drafted on. The lower quartile keeps
the steady samples of a run.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SPEC = "spec"    # a step that verified drafts for every row and proposed new ones
PLAIN = "plain"  # a step without drafts and without a draft pass

# Reasons a request does not draft this step (the label of the skipped counter).
REASON_COST = "cost"          # the cost model says drafting does not pay
REASON_EXPLORE = "explore"    # a plain step measured for the cost model
REASON_BATCH = "batch_size"   # disable_by_batch_size: too many running requests


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (n <= 1 -> 1): buckets of batch size and context."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class CostModelConfig:
    time_window: int = 8           # a bucket's step time: lower quartile of its last this-many
    acceptance_alpha: float = 0.1  # weight of a new acceptance sample in a request's EMA
    hysteresis: float = 0.05       # h: stop below 1 - h, restart above 1 + h
    min_samples: int = 2           # timings a bucket needs before they are trusted
    min_acceptance_samples: int = 4  # verify steps a request needs before it is judged
    # A drafting request stops only when even its acceptance plus this many standard errors
    # would not pay (a verify step gains 1..k+1 tokens: a short unlucky run is not evidence);
    # a stopped one restarts on its estimate alone. 0: judge on the estimate both ways.
    stop_confidence: float = 2.0
    probe_interval: int = 32       # steps between re-probes of requests that stopped
    max_probe_interval: int = 1024
    probe_len: int = 2             # steps per probe (the first proposes, the second verifies)
    plain_run_len: int = 3         # plain steps in a row per plain measurement (module doc)
    # Probing's share of decode time where drafting cannot pay (None: probes follow the
    # interval alone); sets the fewest steps between probes from the cost ratio.
    probe_budget: float | None = 0.02
    min_context_bucket: int = 256  # contexts below this share one bucket
    # While settled (module doc), time one plain step in this many: recording and observing a
    # step time costs the host ~4 us a step (CPU, scripts/time_step_host.py), a few % of a
    # small model's step where drafting cannot pay, and a settled bucket's lower quartile
    # moves slowly anyway. 1: time every step.
    settled_timing_interval: int = 8

    def __post_init__(self):
        if not 0.0 < self.acceptance_alpha <= 1.0:
            raise ValueError(f"acceptance_alpha={self.acceptance_alpha!r} is invalid: it must be "
                             "in (0, 1].")
        if self.probe_budget is not None and not 0.0 < self.probe_budget <= 1.0:
            raise ValueError(f"probe_budget={self.probe_budget!r} is invalid: it must be in "
                             "(0, 1], or None for no cost-based spacing of probes.")
        if not self.stop_confidence >= 0.0:
            raise ValueError(f"stop_confidence={self.stop_confidence!r} is invalid: it must be "
                             ">= 0 (standard errors).")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis={self.hysteresis!r} is invalid: it must be in [0, 1).")
        for name in ("time_window", "min_samples", "min_acceptance_samples", "probe_interval",
                     "max_probe_interval", "probe_len", "plain_run_len", "min_context_bucket",
                     "settled_timing_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an int >= 1.")
        if self.probe_len >= self.probe_interval:
            raise ValueError(f"probe_len={self.probe_len} must be smaller than probe_interval="
                             f"{self.probe_interval}; lengthen the interval or shorten the probe")
        if self.max_probe_interval < self.probe_interval:
            raise ValueError(f"max_probe_interval={self.max_probe_interval} is smaller than "
                             f"probe_interval={self.probe_interval}; raise it")


@dataclass
class _Ema:
    """A request's running acceptance length and how sure of it we are. The first 1/alpha
    samples are averaged evenly (an EMA that starts at its first sample judges a request on
    that one step), later ones exponentially; the variance is updated with the same weights,
    so `stderr` is the spread of the estimate over the ~(2 - alpha) / alpha samples it rests on."""
    value: float = 0.0
    count: int = 0
    var: float = 0.0

    def add(self, sample: float, alpha: float) -> None:
        self.count += 1
        weight = max(alpha, 1.0 / self.count)
        delta = sample - self.value
        self.value += weight * delta
        self.var = (1.0 - weight) * (self.var + weight * delta * delta)

    def stderr(self, alpha: float) -> float:
        effective = min(float(self.count), (2.0 - alpha) / alpha)
        return math.sqrt(self.var / effective) if self.count else 0.0


@dataclass
class _StepTimes:
    """One bucket's step timings of one kind: the lower quartile of the last `window` of them
    (the module doc says why not a mean or a median)."""
    window: int
    recent: deque = field(init=False)
    count: int = 0
    _value: float | None = field(default=None, compare=False, repr=False)  # cache
    # Both kinds of its bucket have min_samples timings (for good: counts only grow).
    paired: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self):
        self.recent = deque(maxlen=self.window)

    def add(self, sample: float) -> None:
        self.recent.append(sample)
        self.count += 1
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            ordered = sorted(self.recent)
            self._value = ordered[(len(ordered) - 1) // 4]
        return self._value


@dataclass
class _RequestState:
    drafting: bool = True         # hysteresis state
    acceptance: _Ema = field(default_factory=_Ema)
    restart_acceptance: bool = False  # set by a probe: the next sample replaces the average


@dataclass(slots=True)
class Candidate:
    """A running request the scheduler may let draft this step."""

    req_id: str
    context_len: int


@dataclass(frozen=True)
class Decision:
    draft: bool
    reason: str | None = None  # why not (REASON_*), None when it drafts


# Shared decisions (frozen): a step's decisions allocate nothing per request.
_DRAFT = Decision(True)
_SKIP_COST = Decision(False, REASON_COST)
_SKIP_EXPLORE = Decision(False, REASON_EXPLORE)
SHARED_DECISIONS = (_SKIP_COST, _DRAFT, _SKIP_EXPLORE)  # the settled engine's first


@dataclass(slots=True)
class _Settled:
    """What decide_step's settled shortcut compares with (module doc, "settled"): the state
    after a step that stopped every request for cost."""

    ids: list[str]               # the requests, in order
    best: float                  # the highest acceptance among them
    override: float | None       # acceptance_override then
    sum_lo: int                  # the summed contexts that keep the step in the same bucket
    sum_hi: int
    spec: _StepTimes | None      # the bucket's own timings (its ratio, read at every step) ...
    plain: _StepTimes | None
    borrowed: float              # ... or, when None, the ratio it borrowed
    pairs_gen: int               # _pairs_gen then (a borrowed ratio holds while it is unchanged)
    # What the shortcut derives from the ratio, as of _pairs_gen == `gen` (every sample of a
    # paired bucket moves _pairs_gen, so nothing they depend on moves while it holds): whether
    # the best acceptance still stays below the restart threshold, and a probe's cost. -1: not
    # derived yet. (Derived once, not at every settled step: a settled engine's policy work is
    # its whole overhead against no speculation, and on the H100 node's host each attribute
    # chain and call costs ~0.3-0.5 us.)
    gen: int = -1
    holds: bool = False
    cost: float = 0.0


class SpeculationCostModel:

    # The settled shortcut of decide_step (tests switch it off to compare with the full loop).
    settled_fast_path = True

    def __init__(self, num_spec_tokens: int, config: CostModelConfig | None = None,
                 acceptance_override: float | None = None,
                 step_time_fn: Callable[[str, int, int], float] | None = None):
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens={num_spec_tokens} is invalid: the cost model "
                             "needs speculation (k >= 1)")
        self.num_spec_tokens = int(num_spec_tokens)
        self.config = config or CostModelConfig()
        # Test / benchmark hooks: a fixed acceptance length instead of the measured one, and
        # synthetic step times (kind, batch size, context) instead of the measured ones.
        self.acceptance_override = acceptance_override
        self.step_time_fn = step_time_fn
        self._times: dict[tuple[str, int, int], _StepTimes] = {}
        self._requests: dict[str, _RequestState] = {}
        self._step = 0
        self._probe_interval = self.config.probe_interval
        self._next_probe = self._probe_interval
        self._probe_start = -self.config.probe_len - 1  # no probe yet
        self._probe_credit = math.inf  # plain steps probing may still spend (held to one probe)
        self._review_pending = False
        self._revived = False
        self._probed_any = False
        self._explored: set[tuple[int, int]] = set()  # buckets whose plain run has started
        self._plain_interval = self.config.probe_interval
        self._next_plain_probe = self._plain_interval
        self._plain_probe_ratio: float | None = None  # the ratio before the last plain probe
        self._plain_probe_step = 0
        self._plain_run_left = 0  # plain steps still to run in the current run (module doc)
        # The settled state (module doc, "settled") after a step that stopped every request.
        self._settled: _Settled | None = None
        # Ratios borrowed from the nearest measured bucket (_bucket_ratio), by bucket, and the
        # count of samples that moved a bucket with both timings (any ratio may have moved).
        self._borrowed: dict[tuple[int, int], float] = {}
        self._pairs_gen = 0
        # observe_step's last bucket: (kind, batch, lowest and highest context, its timings,
        # the key of the other kind's timings of that bucket).
        self._observe_memo: tuple | None = None
        # The probe being timed (observe_probe_step): [first step, end step (exclusive: the
        # probe's speculative steps and the switch back), t_plain, estimate charged, seconds
        # so far, steps so far]; and the last probes' (start, estimate, measured) in plain steps.
        self._probe_audit: list | None = None
        self.probe_costs: deque = deque(maxlen=8)
        # decide_step's last step index (the policy keys its timing records by it), whether
        # that step took the settled shortcut, and the settled steps left untimed in a row.
        self.last_step = -1
        self.last_settled = False
        self._settled_untimed = 0

    # ---- buckets and measurements ------------------------------------------------------------
    def bucket(self, batch_size: int, context_len: int) -> tuple[int, int]:
        return (pow2_bucket(batch_size),
                pow2_bucket(max(int(context_len), self.config.min_context_bucket)))

    def observe_step(self, kind: str, batch_size: int, context_len: int, seconds: float) -> None:
        """One measured decode step of `kind` (SPEC or PLAIN) over `batch_size` requests whose
        mean context is `context_len`."""
        if kind not in (SPEC, PLAIN):
            raise ValueError(f"step kind {kind!r} is invalid: use {SPEC!r} or {PLAIN!r}")
        if self.step_time_fn is not None:
            seconds = float(self.step_time_fn(kind, batch_size, context_len))
        if not seconds > 0.0:
            return  # a clock that did not move says nothing
        memo = self._observe_memo
        if (memo is None or memo[0] != kind or memo[1] != batch_size
                or not memo[2] <= context_len <= memo[3]):
            bucket = self.bucket(batch_size, context_len)
            key = (kind, *bucket)
            times = self._times.get(key)
            if times is None:
                times = self._times[key] = _StepTimes(self.config.time_window)
            memo = self._observe_memo = (kind, batch_size, *self._context_range(bucket[1]),
                                         times, (PLAIN if kind == SPEC else SPEC, *bucket))
        times = memo[4]  # the steady case: the same bucket as the last step's
        times.add(float(seconds))
        if not times.paired and times.count >= self.config.min_samples:
            other = self._times.get(memo[5])
            if other is not None and other.count >= self.config.min_samples:
                times.paired = other.paired = True
        if times.paired:
            # A bucket with both timings moved: ratios borrowed from it are stale. (A sample of a
            # bucket that still lacks the other kind changes no ratio.)
            self._borrowed.clear()
            self._pairs_gen += 1

    def _context_range(self, context_bucket: int) -> tuple[int, int]:
        """The mean contexts whose bucket is `context_bucket`: (context_bucket / 2,
        context_bucket], or everything up to it for the smallest bucket (a subset of the
        bucket's contexts when min_context_bucket is not a power of two)."""
        lo = 0 if context_bucket <= self.config.min_context_bucket else context_bucket // 2 + 1
        return lo, context_bucket

    def _paired(self, bucket: tuple[int, int]) -> tuple[_StepTimes, _StepTimes] | None:
        """The bucket's (spec, plain) timings when both have min_samples, else None."""
        plain = self._times.get((PLAIN, *bucket))
        if plain is None or not plain.paired:
            return None
        return self._times[(SPEC, *bucket)], plain

    def step_time(self, kind: str, batch_size: int, context_len: int) -> float | None:
        """The bucket's average step time, None until it has min_samples timings."""
        times = self._times.get((kind, *self.bucket(batch_size, context_len)))
        if times is None or times.count < self.config.min_samples:
            return None
        return times.value

    def observe_acceptance(self, req_id: str, acceptance_length: float) -> None:
        """Tokens a request gained in one step that verified its drafts (1 + accepted)."""
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestState()
        self._settled = None  # an acceptance moved: the next step judges everyone again
        if state.restart_acceptance:
            state.acceptance = _Ema()
            state.restart_acceptance = False
        state.acceptance.add(float(acceptance_length), self.config.acceptance_alpha)

    def acceptance(self, req_id: str) -> float | None:
        if self.acceptance_override is not None:
            return float(self.acceptance_override)
        state = self._requests.get(req_id)
        # One verify step is too noisy to judge a request on (a single rejected block).
        if state is None or state.acceptance.count < self.config.min_acceptance_samples:
            return None
        return state.acceptance.value

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._settled = None

    # ---- decisions ---------------------------------------------------------------------------
    def cost_ratio(self, batch_size: int, context_len: int) -> float | None:
        """t_spec / t_plain of the bucket; a bucket without both timings borrows the ratio of
        the nearest bucket that has them (a ratio carries over between neighbouring buckets far
        better than absolute times, and it spares every new bucket its own exploration)."""
        return self._bucket_ratio(self.bucket(batch_size, context_len))

    def _bucket_ratio(self, want: tuple[int, int]) -> float | None:
        """cost_ratio of a bucket."""
        pair = self._paired(want)
        if pair is not None:
            return pair[0].value / pair[1].value  # the bucket's own ratio: no scan (every step)
        borrowed = self._borrowed.get(want)
        if borrowed is not None:
            return borrowed
        known = {}
        for (kind, b, c), times in self._times.items():
            if times.count >= self.config.min_samples:
                known.setdefault((b, c), {})[kind] = times.value
        pairs = {key: v[SPEC] / v[PLAIN] for key, v in known.items() if len(v) == 2}
        if not pairs:
            return None
        if want in pairs:
            return pairs[want]

        def distance(key):
            return (abs(key[0].bit_length() - want[0].bit_length())
                    + abs(key[1].bit_length() - want[1].bit_length()), key)

        # Kept until a measured pair moves (observe_step): a settled engine sits in a bucket
        # that only plain steps reach, and this scan ran at every one of its steps.
        ratio = self._borrowed[want] = pairs[min(pairs, key=distance)]
        return ratio

    def expected_speedup(self, req_id: str, batch_size: int, context_len: int) -> float | None:
        """a * t_plain / t_spec, None while the acceptance or the cost ratio is unknown."""
        a = self.acceptance(req_id)
        ratio = self.cost_ratio(batch_size, context_len)
        if a is None or ratio is None:
            return None
        return a / ratio

    def decide(self, candidates: Iterable[Candidate]) -> dict[str, Decision]:
        """Per request: draft this step or not. Call once per engine step."""
        candidates = list(candidates)
        ids, uniform, decisions = self.decide_step([c.req_id for c in candidates],
                                                   [c.context_len for c in candidates])
        return dict.fromkeys(ids, uniform) if uniform is not None else decisions

    def decide_step(self, ids: list[str], contexts: list[int]
                    ) -> tuple[list[str], Decision | None, dict[str, Decision] | None]:
        """decide() as the policy uses it, on the decoding requests' ids and contexts (two
        lists the scheduler fills as it goes: no Candidate per request on its steady path).
        Returns (ids, one decision for all of them or None, the per-request decisions when
        they differ or None). A uniform step (everyone plain, everyone drafting, a settled
        batch) builds no per-request dict."""
        return self.decide_step_total(ids, sum(contexts))

    def decide_step_total(self, ids: list[str], total_context: int
                          ) -> tuple[list[str], Decision | None, dict[str, Decision] | None]:
        """decide_step on the summed contexts (all it reads of them: the bucket is of the mean,
        total // len(ids)); the scheduler's steady path sums as it goes, no list."""
        step = self.last_step = self._step
        self.last_settled = False
        settled = self._settled
        if settled is not None and ids == settled.ids:
            # Settled (module doc): the same requests, all stopped for cost, nobody's
            # acceptance moved since (observe_acceptance and remove_request clear it). This
            # is the full path below, step for step, for a step that stays in the settled
            # bucket, starts no probe and restarts nobody; any other step falls through
            # before anything changed.
            if (settled.sum_lo <= total_context <= settled.sum_hi and self.settled_fast_path
                    and settled.override == self.acceptance_override
                    and not self._review_pending):
                if settled.gen != self._pairs_gen:
                    self._derive_settled(settled)
                if settled.holds:
                    cost = settled.cost
                    budget = self.config.probe_budget
                    credit = self._probe_credit
                    if budget is not None:
                        credit = min(credit + budget, cost)
                    if step < self._next_probe or (budget is not None
                                                   and credit < cost - 1e-12):
                        self._step = step + 1
                        self._probe_credit = credit
                        self.last_settled = True
                        return ids, _SKIP_COST, None
        self._step = step + 1
        if not ids:
            return ids, None, {}
        cfg = self.config
        batch = len(ids)
        context = total_context // batch
        bucket = self.bucket(batch, context)
        if self._plain_run_left > 0:
            # Inside a run of plain measurements (exploration or re-probe): all stay plain.
            self._plain_run_left -= 1
            return ids, _SKIP_EXPLORE, None
        ratio = self._bucket_ratio(bucket)

        if ratio is None and self.step_time(SPEC, batch, context) is None:
            # Nothing to compare with yet: draft (what the user configured) and measure.
            return ids, _DRAFT, None
        if ratio is None:
            # Measure plain steps now: a run of them, the whole batch at once.
            if bucket not in self._explored:
                self._explored.add(bucket)
                self._plain_run_left = self._plain_run - 1
                return ids, _SKIP_EXPLORE, None
            # Explored but the samples were lost (steps with prefills are not timed): go again.
            self._explored.discard(bucket)
            return ids, _DRAFT, None

        if self._plain_probe_ratio is not None:
            # The step after a plain probe's run: back off while the ratio held, else probe as
            # often as at the start.
            moved = abs(ratio / self._plain_probe_ratio - 1.0) > cfg.hysteresis
            self._plain_interval = (cfg.probe_interval if moved else
                                    min(2 * self._plain_interval, cfg.max_probe_interval))
            self._next_plain_probe = self._plain_probe_step + self._plain_interval
            self._plain_probe_ratio = None
        probe_cost = self._probe_cost(ratio)
        self._accrue_probe_credit(probe_cost)
        probing = self._probe_window(step, probe_cost, bucket)
        restart_above = 1.0 + cfg.hysteresis
        override = self.acceptance_override
        self._settled = None
        decisions = {}
        requests = self._requests
        min_acceptance = cfg.min_acceptance_samples
        stop_below = 1.0 - cfg.hysteresis
        confidence, alpha = cfg.stop_confidence, cfg.acceptance_alpha
        probe_start = step == self._probe_start
        unjudged = False  # some request drafts to measure its acceptance, not on its merit
        num_skipped, best_skipped = 0, 0.0
        for req_id in ids:
            # Inlined acceptance() (this loop runs for every decoding request every step).
            state = requests.get(req_id)
            if state is None:
                state = requests[req_id] = _RequestState()
            margin = 0.0
            if override is not None:
                a = float(override)
            elif state.acceptance.count < min_acceptance:
                decisions[req_id] = _DRAFT  # no acceptance yet: measure it
                unjudged = True
                continue
            else:
                a = state.acceptance.value
                if confidence and state.drafting:
                    margin = confidence * state.acceptance.stderr(alpha)
            speedup = a / ratio
            if state.drafting:
                if (a + margin) / ratio < stop_below:
                    state.drafting = False
            elif speedup > restart_above:
                state.drafting = True
                self._revived = True
            if state.drafting:
                decisions[req_id] = _DRAFT
            elif probing:
                if probe_start:
                    state.restart_acceptance = True  # judge it on what the probe measures
                self._probed_any = True
                decisions[req_id] = _DRAFT
            else:
                decisions[req_id] = _SKIP_COST
                num_skipped += 1
                best_skipped = max(best_skipped, a)
        if num_skipped == batch:
            # Everyone stopped: later steps take the settled path above until a request comes,
            # goes or verifies drafts, or a probe starts.
            self._settle(ids, best_skipped, bucket)
            self._review(step)
            return ids, _SKIP_COST, None
        if (not probing and not unjudged and step >= self._next_plain_probe
                and all(d is _DRAFT for d in decisions.values())):
            # Everyone drafts: time a run of plain steps (re-probe t_plain, see the module doc).
            self._plain_probe_ratio, self._plain_probe_step = ratio, step
            self._next_plain_probe = step + self._plain_interval  # provisional, see above
            self._plain_run_left = cfg.plain_run_len - 1
            return ids, _SKIP_EXPLORE, None
        self._review(step)
        return ids, None, decisions

    def _settle(self, ids: list[str], best: float, bucket: tuple[int, int]) -> None:
        """Enter the settled state after a step that stopped all of `ids` (module doc)."""
        batch = len(ids)
        lo, hi = self._context_range(bucket[1])  # of the mean, sum // batch
        pair = self._paired(bucket)
        self._settled = _Settled(
            ids=list(ids),  # a copy: the caller's list may be reused
            best=best, override=self.acceptance_override,
            sum_lo=batch * lo, sum_hi=batch * (hi + 1) - 1,
            spec=pair[0] if pair else None, plain=pair[1] if pair else None,
            borrowed=0.0 if pair else self._borrowed[bucket], pairs_gen=self._pairs_gen)

    def _derive_settled(self, settled: _Settled) -> None:
        """The settled shortcut's ratio-derived values for the current _pairs_gen: the
        bucket's own ratio, or the borrowed one while no paired bucket moved since the settle
        (else it holds no longer: the full path settles anew)."""
        settled.gen = self._pairs_gen
        if settled.spec is not None:
            ratio = settled.spec.value / settled.plain.value
        elif settled.pairs_gen == self._pairs_gen:
            ratio = settled.borrowed
        else:
            settled.holds = False
            return
        settled.holds = settled.best / ratio <= 1.0 + self.config.hysteresis
        settled.cost = self._probe_cost(ratio)

    def _review(self, step: int) -> None:
        """A probed request is judged once it has min_acceptance_samples fresh samples: the
        probe's last step gives the first, each further drafting step one more. Then the
        probe interval backs off or resets."""
        cfg = self.config
        if self._review_pending and step >= (self._probe_start + cfg.probe_len
                                             + cfg.min_acceptance_samples - 1):
            # Nobody revived -> probe half as often (down to max_probe_interval); somebody
            # did, or nobody needed probing (everyone drafted) -> back to probe_interval.
            self._review_pending = False
            if self._revived or not self._probed_any:
                self._probe_interval = cfg.probe_interval
            else:
                self._probe_interval = min(2 * self._probe_interval, cfg.max_probe_interval)
            self._next_probe = max(self._probe_start + self._probe_interval, step + 1)

    @property
    def _plain_run(self) -> int:
        """Plain steps an exploration runs in a row."""
        return max(self.config.min_samples, self.config.plain_run_len)

    def _probe_cost(self, ratio: float) -> float:
        """What one probe costs, in plain steps, where drafting cannot pay: its probe_len +
        min_acceptance_samples - 1 speculative steps, each (ratio - 1) plain steps dearer."""
        cfg = self.config
        return (cfg.probe_len + cfg.min_acceptance_samples - 1) * max(ratio - 1.0, 0.0)

    def _accrue_probe_credit(self, cost: float) -> None:
        """Once per step: probe_budget plain steps of credit, held to at most one probe's
        `cost` (the module doc says why a full credit at the start)."""
        budget = self.config.probe_budget
        if budget is not None:
            self._probe_credit = min(self._probe_credit + budget, cost)

    def _probe_window(self, step: int, cost: float, bucket: tuple[int, int]) -> bool:
        """True during the probe steps [start, start + probe_len). A probe starts once the
        interval has passed and the credit pays for its `cost` (or probe_budget is None)."""
        if step >= self._next_probe:
            if self.config.probe_budget is None or self._probe_credit >= cost - 1e-12:
                if self.config.probe_budget is not None:
                    self._probe_credit -= cost
                    plain = self._times.get((PLAIN, *bucket))
                    if plain is not None and plain.count >= self.config.min_samples:
                        # Its measured cost replaces `cost` once its steps are timed.
                        cfg = self.config
                        end = step + cfg.probe_len + cfg.min_acceptance_samples
                        self._probe_audit = [step, end, plain.value, cost, 0.0, 0]
                self._probe_start = step
                self._next_probe = step + self._probe_interval  # provisional, see the review
                self._review_pending = True
                self._revived = False
                self._probed_any = False
        return self._probe_start <= step < self._probe_start + self.config.probe_len

    def wants_step_timed(self) -> bool:
        """Whether the step decide_step just decided should be timed: always, but for steps
        that took the settled shortcut, of which one in `settled_timing_interval` is (and
        none is skipped while a probe's cost is being audited: observe_probe_step charges
        what every step of the probe measured)."""
        if not self.last_settled or self._probe_audit is not None:
            return True
        self._settled_untimed += 1
        if self._settled_untimed < self.config.settled_timing_interval:
            return False
        self._settled_untimed = 0
        return True

    def observe_probe_step(self, step: int, seconds: float) -> None:
        """The host time of decode step `step` (the index of its decide_step call), timed or
        not: a probe's steps and the plain step after it (the switch back) are charged to the
        probe credit at what they cost, in plain steps of the probe's bucket, in place of the
        estimate the probe was started on (module doc, "re-probe"). Steps not observed (a
        prefill joined) are left out; the audit closes at the first step past the window."""
        audit = self._probe_audit
        if audit is None or step < audit[0]:
            return
        start, end, t_plain, charged = audit[:4]
        if step < end:
            audit[4] += seconds
            audit[5] += 1
        if step >= end - 1:
            self._probe_audit = None
            if not self._probed_any:
                return  # everyone drafted through it: drafting steps, not a probe's cost
            measured = audit[4] / t_plain - audit[5]  # plain steps beyond what they replaced
            self._probe_credit -= measured - charged
            self.probe_costs.append((start, round(charged, 3), round(measured, 3)))

    # ---- introspection -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Bucketed averages for the engine's stats (seconds)."""
        times = {}
        for (kind, batch, context), bucket in sorted(self._times.items()):
            times.setdefault(f"b{batch}_c{context}", {})[kind] = {
                "seconds": bucket.value, "samples": bucket.count, "recent": list(bucket.recent)}
        return {"step_times": times, "probe_interval": self._probe_interval,
                "probe_costs": [list(c) for c in self.probe_costs],
                "plain_probe_interval": self._plain_interval,
                "num_requests_not_drafting": sum(not s.drafting for s in self._requests.values())}
