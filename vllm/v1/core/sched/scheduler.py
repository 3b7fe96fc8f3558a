"""Continuous batching with chunked prefill (default) and preemption by recompute.

Each step spends a token budget (`max_num_batched_tokens`): first the running requests that
decode (each schedules its last sampled token plus its drafts), then the running requests whose
prefill is unfinished (the next chunk of their prompt, as much as the budget leaves), then waiting
requests (front first) while the budget, the sequence budget and the KV blocks last; with chunked
prefill a waiting request is admitted with a first chunk, without it only whole. A request whose
prefill is unfinished after a step samples nothing; it only advances `num_computed_tokens`.

A request that cannot get blocks preempts the newest running request not yet scheduled this step
(or itself): its blocks are freed and it returns to the FRONT of the waiting queue with prompt +
outputs as its new prompt, to be prefilled again, so a scheduled request's KV is never touched by
anyone else. This works the same mid-prefill.

Async scheduling (`async_scheduling=True`): step N+1 is scheduled while step N still runs, before
its sampled tokens are known. With a drafter this holds only for steps that verify no drafts
(`SchedulerOutput.advanced`); a verifying step is scheduled once nothing is in flight and is
applied synchronously. A scheduled request therefore advances
`num_computed_tokens` at schedule time (exact without drafts: every scheduled token is computed)
and, when the step samples, holds one output placeholder until `update_from_output` brings the
token. A request whose pending token is its last (max_tokens, max_model_len) is not scheduled
again; one that stops on EOS or a stop string runs one extra step whose output is dropped.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.request import Request, RequestStatus
from vllm.v1.metrics.stats import mean_acceptance_length, per_position_acceptance
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.spec_decode.cost_model import Candidate
from vllm.v1.spec_decode.policy import SpeculationPolicy, StepPlan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCoreOutput:
    """Tokens a request gained this step (after stop truncation) and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    def as_dict(self) -> dict:
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": per_position_acceptance(self.num_drafts,
                                                                    self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def _sampled_unfinished_prefill(request: Request, num_scheduled: int,
                                num_sampled: int) -> RuntimeError:
    """The error of a runner output that sampled tokens for a prefill chunk short of the
    prompt's end (both synchronous update paths raise it)."""
    return RuntimeError(
        f"model runner sampled {num_sampled} tokens for request {request.request_id!r}, whose "
        f"prefill is unfinished ({request.num_computed_tokens} + {num_scheduled} of "
        f"{request.num_tokens} tokens); expected none")


class Scheduler:

    def __init__(self, vllm_config, num_blocks: int, block_pool=None):
        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        spec_config = vllm_config.speculative_config
        self.max_model_len = int(model_config.max_model_len)
        self.max_num_batched_tokens = int(vllm_config.max_num_batched_tokens)
        self.enable_chunked_prefill = bool(getattr(vllm_config, "enable_chunked_prefill", True))
        self.num_spec_tokens = int(spec_config.num_speculative_tokens) if spec_config else 0
        # Every running request needs room for its token plus its drafts each step; capping the
        # batch this way means a running request is never left unscheduled for lack of tokens.
        tokens_per_running_req = 1 + self.num_spec_tokens
        self.max_num_running_reqs = min(int(vllm_config.max_num_seqs),
                                        self.max_num_batched_tokens // tokens_per_running_req)
        if self.max_num_running_reqs < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot fit one decode step "
                f"of {tokens_per_running_req} tokens (1 + num_speculative_tokens); raise it")
        dcp_size = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
        self.kv_cache_manager = KVCacheManager(num_blocks, vllm_config.cache_config.block_size,
                                               dcp_size, block_pool=block_pool)
        longest = self.max_model_len + self.num_spec_tokens + 1
        if self.kv_cache_manager.num_blocks_for(longest) > self.kv_cache_manager.num_total_blocks:
            raise ValueError(
                f"the KV cache holds {self.kv_cache_manager.num_total_blocks} blocks of "
                f"{self.kv_cache_manager.tokens_per_block} tokens, fewer than one request of "
                f"max_model_len={self.max_model_len} needs (+{self.num_spec_tokens + 1} lookahead); "
                "lower max_model_len or give the KV cache more memory/blocks")

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self.finished_req_ids: set[str] = set()  # runner must drop these at the next step
        self.spec_decoding_stats = SpecDecodingStats(self.num_spec_tokens) if spec_config else None
        # Which decoding requests draft each step (disable_by_batch_size: None / N / "auto").
        if (spec_config is not None and spec_config.disable_by_batch_size == "auto"
                and getattr(parallel_config, "distributed_executor_backend", None)
                == "external_launcher"):
            # Each torchrun process schedules on its own: decisions from each process's own
            # clock would differ between ranks and break their lock-step.
            raise ValueError("disable_by_batch_size='auto' decides from this process's own step "
                             "times, but with distributed_executor_backend='external_launcher' "
                             "every rank schedules on its own and the ranks would diverge; use "
                             "an int N (same decision on every rank) or null")
        self.spec_policy = SpeculationPolicy.from_config(spec_config) if spec_config else None
        self.num_preemptions = 0
        # With a speculative config, only steps that verify no drafts are scheduled ahead
        # (`SchedulerOutput.advanced`); a verifying step is scheduled after the previous step
        # was collected and applied synchronously (see `_schedule_general`).
        self.async_scheduling = bool(getattr(vllm_config, "async_scheduling", False))

    # ---- requests in / out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n = request.num_tokens
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; "
                             "use a unique request id")
        if n < 1:
            raise ValueError("the prompt is empty; give at least one prompt token")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, more than max_model_len="
                             f"{self.max_model_len}; shorten the prompt or raise max_model_len")
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} (prompts are prefilled whole); shorten "
                             "the prompt or raise max_num_batched_tokens")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); frees their blocks. Unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a finished status, got {status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        self.finished_req_ids.add(request.request_id)
        if self.spec_policy is not None:
            self.spec_policy.remove_request(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------------------------
    # The steady-decode fast path (`_schedule_steady_decode`); tests switch it off to compare it
    # with the general path.
    steady_decode_fast_path = True
    # The synchronous no-draft update (`_update_from_plain_output`); tests switch it off too.
    plain_update_fast_path = True
    # The async update's no-stop-possible check before `_check_stop`; tests switch it off too.
    async_stop_fast_path = True

    def schedule(self) -> SchedulerOutput:
        plan = None
        if self.steady_decode_fast_path:
            result = self._schedule_steady_decode()
            if isinstance(result, SchedulerOutput):
                return result
            plan = result  # a plan the fast path made for this step but could not use
        return self._schedule_general(plan)

    def _schedule_steady_decode(self) -> SchedulerOutput | StepPlan | None:
        """The common step of a busy engine, in one lean pass: no admission possible (nothing
        waits, or the batch is full), every running request decodes one token, nobody verifies
        drafts and the pool has the blocks for all of them. Then the general path would
        schedule exactly the running requests in order, one token each, with no preemption and
        no admission; this builds the same SchedulerOutput without its per-request helper calls.

        Taken by a plain engine and by a speculative engine whose policy lets nobody draft this
        step (disable_by_batch_size N reached, or "auto" with every request off); the policy's
        plan, counts and step timing are made exactly as the general path makes them. Returns
        None (nothing changed) when a condition fails before the policy was asked, the policy's
        plan when one fails after (the general path then uses that plan: asking twice would
        advance the cost model's clock twice), and the output otherwise."""
        policy = self.spec_policy
        if policy is not None and not policy.active:
            return None  # no policy: everyone drafts every step
        if policy is None and self.num_spec_tokens:
            return None  # (no such engine: a speculative config always has a policy object)
        if self.waiting and len(self.running) < self.max_num_running_reqs:
            return None  # an admission may follow (with a full batch none can)
        kv = self.kv_cache_manager
        # kv.num_new_blocks_needed(id, _slots_needed(request, 1)), inlined: this loop runs for
        # every running request at every step.
        held_blocks = kv.req_to_blocks
        tokens_per_block = kv.tokens_per_block
        headroom = 1 + self.num_spec_tokens + 1
        no_blocks = ()
        check_placeholders = self.async_scheduling
        max_model_len = self.max_model_len
        scheduled: list[Request] = []
        grow: list[tuple[Request, int]] = []
        new_blocks_total = 0
        # "auto" decides from the batch's summed contexts (`planned`: a request's tokens plus
        # the one in flight under async scheduling; the general path uses the same count).
        total_context = 0
        for request in self.running:
            num_out = len(request.output_token_ids)
            pending = request.num_output_placeholders
            planned = request.num_prompt_tokens + num_out + pending
            if check_placeholders and pending > 0 and (
                    num_out + pending >= request.max_tokens or planned >= max_model_len):
                continue  # its in-flight token is its last (_finishes_with_placeholders)
            computed = request.num_computed_tokens
            if planned - computed != 1:
                return None  # an unfinished prefill: the general path
            num_tokens = computed + headroom
            need = -(-num_tokens // tokens_per_block) - len(
                held_blocks.get(request.request_id, no_blocks))
            if need > 0:
                new_blocks_total += need
                grow.append((request, num_tokens))
            scheduled.append(request)
            total_context += planned
        if len(scheduled) > self.max_num_batched_tokens:
            return None  # cannot happen (max_num_running_reqs); the general path asserts it
        plan = None
        req_ids = [r.request_id for r in scheduled]
        if policy is not None:
            if not scheduled:
                return None  # nothing runs: the general path (it asks the policy itself)
            # The general path's call: the decoding requests in running order (only "auto"
            # reads the ids and contexts).
            plan = policy.plan_ids_total(req_ids, total_context, len(self.running))
            if not plan.lets_nobody_draft:
                return plan  # someone drafts: the general path schedules the drafts
        if new_blocks_total > kv.num_free_blocks:
            return plan  # someone must be preempted: the general path picks the victims
        grown = {}
        for request, num_tokens in grow:
            grown[request.request_id] = kv.allocate_slots(request.request_id, num_tokens)
        cached = CachedRequestData(
            req_ids=req_ids,
            new_block_ids=[grown.get(req_id) or [] for req_id in req_ids] if grown
            else [[] for _ in req_ids],
            num_computed_tokens=[r.num_computed_tokens for r in scheduled])
        num_scheduled = dict.fromkeys(req_ids, 1)
        output = SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=len(req_ids),
            scheduled_spec_decode_tokens={}, finished_req_ids=self.finished_req_ids,
            preempted_req_ids=set(),
            propose_drafts=plan.propose if plan is not None else True,
            advanced=check_placeholders)
        self.finished_req_ids = set()
        if check_placeholders:
            # _advance_scheduled: the token counts as computed and the step samples one token.
            for request in scheduled:
                request.num_computed_tokens += 1
                request.num_output_placeholders += 1
        if plan is not None:
            # The general path's accounting of a step whose decodes were all scheduled.
            policy.account_steady(output, plan, req_ids, total_context)
        return output

    def _schedule_general(self, plan: StepPlan | None = None) -> SchedulerOutput:
        """Every step the fast path does not take. `plan`: the policy's plan for this step,
        when the fast path already asked for it (None: ask here)."""
        token_budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: list[Request] = []

        # Decodes first (a decode is one request-step of 1 + drafts tokens, and
        # max_num_running_reqs guarantees they all fit), then the unfinished prefills
        # (_is_prefilling, inlined: every step of an engine that drafts comes here).
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            if (r.num_prompt_tokens + len(r.output_token_ids) + r.num_output_placeholders
                    - r.num_computed_tokens > 1):
                prefills.append(r)
            else:
                decodes.append(r)
        if self.async_scheduling:
            # A request whose in-flight token is its last finishes when that token arrives: it
            # is not scheduled, so the policy neither plans nor counts it either (counted, it
            # added one skipped decode per request to the policy's stats).
            decodes = [r for r in decodes if not self._finishes_with_placeholders(r)]
            prefills = [r for r in prefills if not self._finishes_with_placeholders(r)]
        order = decodes + prefills
        keep_drafts = True  # False: the policy lets nobody draft this step (checked once)
        plan_uniform = True  # one decision for every request (no per-request look-up)
        if self.spec_policy is not None and self.spec_policy.active:
            # A request the policy keeps from drafting decodes plainly: its drafts are dropped.
            # Candidates are built only by a policy that decides per request ("auto").
            if plan is None:
                plan = self.spec_policy.plan(
                    (Candidate(r.request_id, self._num_planned_tokens(r)) for r in decodes),
                    num_running=len(self.running))
            keep_drafts = not plan.nobody_drafts
            plan_uniform = not plan.decisions
        if keep_drafts and self.num_spec_tokens and self.async_scheduling \
                and self._step_in_flight():
            # A step scheduled ahead is still running: its drafts (if any) are unknown and this
            # step must have exact counts, so nobody verifies now. The plan and its counts stay
            # as they are: the engine leaves only steps that propose nothing in flight, and the
            # synchronous engine would find no drafts to verify after them either.
            keep_drafts = False
        kv = self.kv_cache_manager
        held_blocks, tokens_per_block = kv.req_to_blocks, kv.tokens_per_block
        headroom = self.num_spec_tokens + 1  # _slots_needed's, inlined below
        running_status = RequestStatus.RUNNING
        for request in order:
            if request.status != running_status:
                continue  # preempted earlier in this step
            num_tokens = request.num_prompt_tokens + len(request.output_token_ids)
            remaining = num_tokens + request.num_output_placeholders - request.num_computed_tokens
            if remaining > 1:  # unfinished prefill: the next chunk, no drafts
                drafts: list[int] = []
                num_new = min(remaining, token_budget)
                if num_new <= 0:
                    continue  # the budget is spent; it continues next step
            else:
                if not keep_drafts or (plan is not None and not plan_uniform
                                       and not plan.drafts(request.request_id)):
                    drafts = []
                else:
                    # Drafts must not run past max_model_len (the last token sits at
                    # num_tokens - 1).
                    drafts = request.spec_token_ids[:max(0, self.max_model_len - num_tokens)]
                num_new = 1 + len(drafts)
                assert num_new <= token_budget, "max_num_running_reqs keeps decode steps in budget"
            need = request.num_computed_tokens + num_new + headroom
            held = held_blocks.get(request.request_id)
            if held is not None and len(held) * tokens_per_block >= need:
                new_blocks = []  # what allocate_slots returns when no block is missing
            else:
                new_blocks = kv.allocate_slots(request.request_id, need)
            while new_blocks is None:
                victim = self._pick_victim(request, num_scheduled)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(request.request_id, need)
            if new_blocks is None:
                continue  # the request preempted itself
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            if drafts:
                spec_tokens[request.request_id] = drafts  # the slice above is already a copy
            token_budget -= num_new

        # No admissions in a step that had to preempt: the pool is known to be short.
        while (not preempted and self.waiting and token_budget > 0
               and len(self.running) < self.max_num_running_reqs):
            request = self.waiting[0]
            num_tokens = request.num_tokens
            if not self.enable_chunked_prefill and num_tokens > self.max_num_batched_tokens:
                # Only a preempted request can grow past the prefill budget; it cannot be
                # recomputed, so it ends here as length-capped rather than blocking the queue.
                logger.warning("request %s (%d tokens) cannot be re-prefilled within "
                               "max_num_batched_tokens=%d after preemption; finishing it",
                               request.request_id, num_tokens, self.max_num_batched_tokens)
                self.waiting.popleft()
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free_request(request)
                continue
            if self.enable_chunked_prefill:
                num_new = min(num_tokens, token_budget)
            elif num_tokens > token_budget:
                break
            else:
                num_new = num_tokens
            request.num_computed_tokens = 0
            need = self._slots_needed(request, num_new)
            new_blocks = self.kv_cache_manager.allocate_slots(request.request_id, need)
            if new_blocks is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=request.all_token_ids,
                block_ids=list(self.kv_cache_manager.get_block_ids(request.request_id)),
                num_computed_tokens=0, sampling_params=request.sampling_params))
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            propose_drafts=plan.propose if plan is not None else True,
        )
        self.finished_req_ids = set()
        if self.async_scheduling and not spec_tokens:
            # Exact counts (nothing to reject): schedule ahead. A verifying step is applied
            # synchronously instead (nothing is in flight when it is scheduled, see above).
            self._advance_scheduled(num_scheduled)
            output.advanced = True
        if plan is not None:
            # Without a preemption every decode was scheduled (a decode always fits the budget).
            scheduled_decodes = decodes if not preempted else [
                r for r in decodes if r.request_id in num_scheduled]
            if plan_uniform:
                self.spec_policy.count(plan, (), len(scheduled_decodes))
            else:
                self.spec_policy.count(plan, (r.request_id for r in scheduled_decodes))
            if self.spec_policy.cost_model is not None and scheduled_decodes:
                # Only decode rows carry drafts (a prefill chunk never does).
                self.spec_policy.plan_timing_counts(
                    output, plan, len(scheduled_decodes), len(spec_tokens),
                    sum(self._num_planned_tokens(r) for r in scheduled_decodes)
                    // len(scheduled_decodes),
                    pure_decode=len(scheduled_decodes) == len(num_scheduled))
            elif self.spec_policy.cost_model is not None:
                self.spec_policy.plan_timing_counts(output, plan, 0, 0, 0, pure_decode=False)
        elif self.spec_policy is not None:
            # No policy: every scheduled decode drafts (a count, no per-request work).
            self.spec_policy.num_drafted += len(decodes) if not preempted else sum(
                1 for r in decodes if r.request_id in num_scheduled)
        return output

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The engine's host wall time of the step that ran `scheduler_output` (the cost
        model's measurement; the step already ends in the runner's one device->host copy). The
        policy keys its timing records by output, so a step scheduled ahead (async) finds its
        own."""
        policy = self.spec_policy
        # (no timing record pending: no step to time; a disable_by_batch_size engine never
        # has one, a settled "auto" engine rarely does, CostModelConfig.settled_timing_interval)
        if policy is None or not policy.pending_timings:
            return
        policy.observe_step_time(scheduler_output, seconds)

    def _step_in_flight(self) -> bool:
        """A step scheduled ahead whose tokens have not arrived (async scheduling): some
        running request holds an output placeholder."""
        return any(r.num_output_placeholders for r in self.running)

    @staticmethod
    def _num_planned_tokens(request: Request) -> int:
        """Known tokens plus the in-flight ones (async scheduling; 0 placeholders otherwise)."""
        return request.num_tokens + request.num_output_placeholders

    def _is_prefilling(self, request: Request) -> bool:
        """True while more than the last known token still needs its KV (an unfinished
        prefill); a decoding request has exactly one uncomputed token, its last sampled one."""
        return self._num_planned_tokens(request) - request.num_computed_tokens > 1

    def _finishes_with_placeholders(self, request: Request) -> bool:
        pending = request.num_output_placeholders
        return pending > 0 and (request.num_output_tokens + pending >= request.max_tokens
                                or request.num_tokens + pending >= self.max_model_len)

    def _advance_scheduled(self, num_scheduled: dict[str, int]) -> None:
        """Async scheduling: the scheduled tokens count as computed from now on (no drafts, so
        none can be rejected), and a step that reaches the last planned token samples one
        token, which is a placeholder until its id arrives."""
        for req_id, num_new in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == self._num_planned_tokens(request):
                request.num_output_placeholders += 1

    def _slots_needed(self, request: Request, num_new: int) -> int:
        """Tokens the request's blocks must cover after this step: its tokens plus k + 1 of
        headroom. The headroom is needed even by an unfinished prefill chunk: the drafter
        still runs over that row (its drafts are discarded) and writes draft KV just past it."""
        return request.num_computed_tokens + num_new + self.num_spec_tokens + 1

    def _pick_victim(self, request: Request, num_scheduled: dict[str, int]) -> Request:
        """The newest running request not scheduled yet this step; the request itself when
        every other candidate is already scheduled (a scheduled request's KV stays put)."""
        for candidate in reversed(self.running):
            if candidate is not request and candidate.request_id not in num_scheduled:
                return candidate
        return request

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop the KV, requeue at the front; outputs so far become prompt."""
        self.kv_cache_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # An in-flight token of a preempted request still arrives (update_from_output keeps it).
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def requeue_for_recompute(self, request_ids: Iterable[str]) -> None:
        """Preempt these running requests (recompute policy) after a step that failed: their
        runner state may be half-updated, so they are prefilled again from their tokens."""
        for req_id in reversed(list(request_ids)):  # appendleft: keep their order at the front
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)

    # ---- results of a step -------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if scheduler_output.advanced:
            return self._update_from_async_output(scheduler_output, runner_output)
        if self.plain_update_fast_path and not scheduler_output.scheduled_spec_decode_tokens:
            # No drafts were verified: the acceptance bookkeeping below (spec stats, the
            # policy's acceptance) ignores zero-draft rows, so the lean pass is exact.
            return self._update_from_plain_output(scheduler_output, runner_output)
        # Every synchronous step that verified drafts comes here (every step of an engine that
        # drafts every step), so the loop binds what it reads once and checks a row's stops
        # in one test where none can fire (_check_stop's conditions, for the row's last token).
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        all_sampled = runner_output.sampled_token_ids
        spec_out = runner_output.spec_token_ids
        stats = self.spec_decoding_stats
        policy = self.spec_policy
        running_status = RequestStatus.RUNNING
        check_stop = self._check_stop
        max_model_len = self.max_model_len
        no_drafts = ()
        for row, req_id in enumerate(runner_output.req_ids):
            request = requests.get(req_id)
            num_scheduled = scheduled.get(req_id)
            if request is None or num_scheduled is None or request.status != running_status:
                continue  # finished or aborted while the step ran
            sampled = all_sampled[row]
            num_sampled = len(sampled)
            num_drafts = len(spec_tokens.get(req_id, no_drafts))
            output_ids = request.output_token_ids
            num_out = len(output_ids)
            if request.num_computed_tokens + num_scheduled < request.num_prompt_tokens + num_out:
                # A prefill chunk that does not reach the end of the prompt samples nothing.
                if num_sampled:
                    raise _sampled_unfinished_prefill(request, num_scheduled, num_sampled)
                request.num_computed_tokens += num_scheduled
                continue
            if not 1 <= num_sampled <= num_drafts + 1:
                raise RuntimeError(
                    f"model runner returned {num_sampled} tokens for request {req_id!r}, which "
                    f"verified {num_drafts} drafts; expected between 1 and {num_drafts + 1}")
            num_accepted = num_sampled - 1
            # The KV of rejected drafts is garbage: they do not count as computed.
            request.num_computed_tokens += num_scheduled - (num_drafts - num_accepted)
            if num_drafts:  # (both ignore rows without drafts)
                if stats is not None:
                    stats.observe(num_drafts, num_accepted)
                if policy is not None:
                    policy.observe_acceptance(req_id, num_drafts, num_accepted)
            last = num_out + num_sampled  # the output length after the row's last token
            finished = False
            if (last < request.max_tokens and not request.stop_token_ids
                    and request.num_prompt_tokens + last < max_model_len
                    and (request.ignore_eos or last < request.min_tokens
                         or request.eos_token_id not in sampled)):
                # No stop can fire on any of the row's tokens: every condition of _check_stop
                # is false for the last one, hence for the earlier ones.
                output_ids.extend(sampled)
                new_tokens = list(sampled)
            else:
                new_tokens = []
                for token in sampled:
                    output_ids.append(token)
                    new_tokens.append(token)
                    if check_stop(request, token):
                        finished = True
                        break
            if finished:
                self.running.remove(request)
                self._free_request(request)
                outputs.append(EngineCoreOutput(req_id, new_tokens, request.get_finished_reason(),
                                                request.stop_reason))
            else:
                request.spec_token_ids = list(spec_out[row]) if spec_out is not None else []
                outputs.append(EngineCoreOutput(req_id, new_tokens, None, request.stop_reason))
        return outputs

    def _update_from_plain_output(self, scheduler_output: SchedulerOutput,
                                  runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """update_from_output of a synchronous step that verified no drafts (a plain engine,
        or a speculative one whose policy let nobody draft): what the general loop does with
        zero drafts, in one lean pass (one token per completing row, nothing rejected, and
        the drafts proposed after the step, if any, kept for the next one)."""
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        scheduled = scheduler_output.num_scheduled_tokens
        all_sampled = runner_output.sampled_token_ids
        spec_out = runner_output.spec_token_ids
        running_status = RequestStatus.RUNNING
        check_stop = self._check_stop
        for row, req_id in enumerate(runner_output.req_ids):
            request = requests.get(req_id)
            num_scheduled = scheduled.get(req_id)
            if request is None or num_scheduled is None or request.status != running_status:
                continue  # finished or aborted while the step ran
            sampled = all_sampled[row]
            num_sampled = len(sampled)
            computed = request.num_computed_tokens + num_scheduled
            if computed < request.num_prompt_tokens + len(request.output_token_ids):
                if num_sampled:
                    raise _sampled_unfinished_prefill(request, num_scheduled, num_sampled)
                request.num_computed_tokens = computed
                continue
            if num_sampled != 1:
                raise RuntimeError(
                    f"model runner returned {num_sampled} tokens for request {req_id!r}, which "
                    f"verified no drafts; expected 1")
            request.num_computed_tokens = computed
            token = sampled[0]
            request.output_token_ids.append(token)
            if check_stop(request, token):
                self.running.remove(request)
                self._free_request(request)
                outputs.append(EngineCoreOutput(req_id, [token], request.get_finished_reason(),
                                                request.stop_reason))
                continue
            proposed = spec_out[row] if spec_out is not None else None
            if proposed:
                request.spec_token_ids = list(proposed)  # the runner's lists may be shared
            elif request.spec_token_ids:
                request.spec_token_ids = []
            outputs.append(EngineCoreOutput(req_id, [token], None, request.stop_reason))
        return outputs

    def _update_from_async_output(self, scheduler_output: SchedulerOutput,
                                  runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """The tokens of a step scheduled with placeholders (its computed counts advanced at
        schedule time). A request preempted after the step was launched keeps its token: it is
        prefilled again later with it."""
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        scheduled = scheduler_output.num_scheduled_tokens
        all_sampled = runner_output.sampled_token_ids
        running_status, preempted_status = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        check_stop = self._check_stop
        max_model_len = self.max_model_len
        fast_stop_check = self.async_stop_fast_path
        # A speculative engine's step may have proposed drafts (then the engine collected it
        # before scheduling the next step): they are kept as after a synchronous plain step.
        spec_out = runner_output.spec_token_ids
        for row, req_id in enumerate(runner_output.req_ids):
            request = requests.get(req_id)
            if request is None or req_id not in scheduled:
                continue  # finished or aborted while the step ran: its output is dropped
            sampled = all_sampled[row]
            if spec_out is not None and request.status == running_status:
                # keep the row's proposal (inline: every row of every step of a speculative engine)
                proposed = spec_out[row]
                if proposed:
                    request.spec_token_ids = list(proposed)  # the runner's lists may be shared
                elif request.spec_token_ids:
                    request.spec_token_ids = []
            if len(sampled) != 1:
                if not len(sampled):
                    continue  # an unfinished prefill chunk
                raise RuntimeError(f"model runner returned {len(sampled)} tokens for request "
                                   f"{req_id!r} in an async step without drafts; expected 1")
            status = request.status
            running = status == running_status
            if running:
                request.num_output_placeholders -= 1
            elif status != preempted_status:
                continue
            token = sampled[0]
            output_ids = request.output_token_ids
            output_ids.append(token)
            num_out = len(output_ids)
            if (fast_stop_check and num_out < request.max_tokens and not request.stop_token_ids
                    and request.num_prompt_tokens + num_out < max_model_len
                    and (token != request.eos_token_id or request.ignore_eos
                         or num_out < request.min_tokens)):
                # No stop can fire on this token (each of _check_stop's conditions is false):
                # the common decode row, without the call.
                outputs.append(EngineCoreOutput(req_id, [token], None, request.stop_reason))
                continue
            if check_stop(request, token):
                (self.running if running else self.waiting).remove(request)
                self._free_request(request)
                outputs.append(EngineCoreOutput(req_id, [token], request.get_finished_reason(),
                                                request.stop_reason))
            else:
                outputs.append(EngineCoreOutput(req_id, [token], None, request.stop_reason))
        return outputs

    def _check_stop(self, request: Request, token: int) -> bool:
        """Append-time stop check of one sampled token (already in output_token_ids); sets the
        finished status and returns True when the request ends here."""
        num_out = len(request.output_token_ids)
        if num_out >= request.min_tokens:
            if token == request.eos_token_id and not request.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if request.stop_token_ids and token in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if num_out >= request.max_tokens or request.num_prompt_tokens + num_out >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ---- metrics --------------------------------------------------------------------------
    def get_stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_total_blocks,
            "num_preemptions": self.num_preemptions,
            "spec_decode": self._spec_decode_stats(),
        }

    def _spec_decode_stats(self) -> dict | None:
        if self.spec_decoding_stats is None:
            return None
        stats = self.spec_decoding_stats.as_dict()
        stats["policy"] = self.spec_policy.stats()
        return stats
