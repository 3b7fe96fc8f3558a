"""The block drafters' draft step prepared while the verify step runs (early_draft.py), on the
CPU (tiny model, TORCH_MLA, eager, float32) with VLLM_EARLY_DRAFT_METADATA=1.

Oracles: the same engine with the early path off (drafts, hence per-step acceptances, must be
identical: a wrong device-side length would change the drafts but not the greedy output) and
plain greedy decoding; and, step by step, the host's exact new computed counts against the
device counts the runner derived before it had them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.utils.call_probes import record_accepted
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.spec_decode.early_draft import ENV_FLAG, EarlyDraftTuner, early_draft_mode

PROMPTS = [[(7 * i + 13 * j) % 200 + 20 for j in range(10 + 7 * i)] for i in range(3)]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Enough verify steps for the tuner's trial in one batch bucket (3 late + 3 early + after),
# however well the shipped drafter drafts.
LONG = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)


def generate(method: str | None, mode: str, monkeypatch, trace: dict | None = None,
             params: SamplingParams = GREEDY):
    monkeypatch.setenv(ENV_FLAG, mode)
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4}
    with LLM(device="cpu", max_model_len=128, max_num_seqs=4, speculative_config=spec) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        accepted_per_step = record_accepted(runner)
        speculator = runner.speculator
        if trace is not None:
            trace["query_len"] = speculator.query_len
            inner_prepare, inner_propose = speculator.prepare_early, speculator.propose

            def prepare_early(num_reqs, accepted, next_ids, upper, target,
                              lower_num_computed_new=None, **terms):
                # the device's new computed counts, as prepare_early documents its terms
                exact = accepted[:num_reqs].to(torch.int64) + terms.get("accepted_offset", 0)
                if terms.get("accepted_extra") is not None:
                    exact = exact + terms["accepted_extra"][:num_reqs]
                trace["prepared"].append((exact.tolist(), list(upper[:num_reqs]),
                                          list(lower_num_computed_new[:num_reqs])))
                return inner_prepare(num_reqs, accepted, next_ids, upper, target,
                                     lower_num_computed_new=lower_num_computed_new, **terms)

            def propose(inputs):
                early = speculator.__dict__.get("_early")
                exact = [int(v) for v in inputs.num_computed_new[:inputs.num_reqs]]
                trace["proposed"].append((early is not None, exact))
                return inner_propose(inputs)

            speculator.prepare_early, speculator.propose = prepare_early, propose
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        counts = (None if speculator is None
                  else (speculator.early_refreshes, speculator.early_rebuilds,
                        speculator.early_launches))
    return [list(o.outputs[0].token_ids) for o in outputs], accepted_per_step, counts


@pytest.fixture(scope="module")
def plain():
    monkeypatch = pytest.MonkeyPatch()
    try:
        return generate(None, "0", monkeypatch)[0]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_early_draft_steps_equal_the_late_ones(plain, method, monkeypatch):
    trace = {"prepared": [], "proposed": []}
    tokens, accepted, (refreshes, rebuilds, launches) = generate(method, "1", monkeypatch,
                                                                 trace)
    late_tokens, late_accepted, late_counts = generate(method, "0", monkeypatch)
    assert tokens == late_tokens == plain
    assert accepted == late_accepted  # the same drafts in every step
    assert late_counts == (0, 0, 0)
    assert launches == 0  # without device lowering the draft step waits for the host lengths
    # Every proposal that found an early draft step pairs with the prepare_early before it:
    # the device's new computed counts are the host's exact ones, the planners' bound above.
    early_steps = [exact for early, exact in trace["proposed"] if early]
    assert len(early_steps) == len(trace["prepared"]) >= MAX_TOKENS // 4
    lowered = 0
    for (device, upper, lower), exact in zip(trace["prepared"], early_steps):
        assert device == exact
        # the host's bounds (every draft accepted / every draft rejected) hold the exact counts
        assert all(u >= e >= lo for u, e, lo in zip(upper, exact, lower))
        lowered += any(u > e for u, e in zip(upper, exact))
    assert lowered > 0  # some drafts were rejected: the bound had to be lowered
    # TORCH_MLA cannot lower planned lengths in place: every early step was built again
    assert refreshes == 0 and rebuilds == len(early_steps)


def test_auto_leaves_eager_cpu_engines_alone(monkeypatch):
    """"auto" prepares early only with a captured draft step and builders that lower lengths
    in place (FlashInfer MLA); an eager CPU engine has neither."""
    trace = {"prepared": [], "proposed": []}
    tokens, _, counts = generate("dspark", "auto", monkeypatch, trace)
    assert trace["prepared"] == [] and counts == (0, 0, 0)
    assert len(tokens) == len(PROMPTS)


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=ENV_FLAG):
        early_draft_mode()


def test_the_default_is_the_measured_auto(monkeypatch):
    """Slower on the tiny model, faster at V3-rank dims (early_draft.py): the default "auto"
    decides per engine from its own A/B (EarlyDraftTuner)."""
    monkeypatch.delenv(ENV_FLAG, raising=False)
    assert early_draft_mode() == "auto"


def _run_tuner(tuner, step_seconds, num_reqs=8, steps=200):
    """Feed `tuner` the steps a runner would: each step asks use_early, then reports its time
    (step_seconds(early) for the path it took). Returns the path of every step."""
    paths = []
    for _ in range(steps):
        early = tuner.use_early(num_reqs)
        paths.append(early)
        tuner.observe(num_reqs, early, step_seconds(early))
    return paths


@pytest.mark.parametrize("early_s, chosen", [(0.9, True), (1.1, False), (0.995, False)])
def test_the_tuner_keeps_the_early_path_only_where_it_measures_faster(early_s, chosen):
    tuner = EarlyDraftTuner(trial_steps=8, recheck_steps=1000, min_gain=0.01)
    paths = _run_tuner(tuner, lambda early: early_s if early else 1.0, steps=60)
    # 9 late steps (the first one, the switch, not counted), 9 early ones, then the decision.
    assert paths[:9] == [False] * 9 and paths[9:18] == [True] * 9
    assert paths[18:] == [chosen] * 42
    assert tuner.history == [(8, 1.0, early_s, chosen)]


def test_the_tuner_judges_each_batch_bucket_alone_and_again_after_recheck_steps():
    tuner = EarlyDraftTuner(trial_steps=4, recheck_steps=20, min_gain=0.0)
    _run_tuner(tuner, lambda early: 0.5 if early else 1.0, num_reqs=3, steps=10)
    assert tuner.use_early(4) is True   # bucket 4 (3 and 4 rows): decided early
    assert tuner.use_early(5) is False  # bucket 8: its own trial, starting late
    # bucket 4's costs turn around: after 20 more steps it is tried again and flips
    _run_tuner(tuner, lambda early: 2.0 if early else 1.0, num_reqs=4, steps=20)
    assert tuner.use_early(4) is False and len(tuner.history) == 1
    _run_tuner(tuner, lambda early: 2.0 if early else 1.0, num_reqs=4, steps=10)
    assert [h[3] for h in tuner.history] == [True, False]
    # a sample of the other path (a step launched before the window switched) is ignored
    fresh = EarlyDraftTuner(trial_steps=2)
    fresh.observe(1, True, 100.0)
    assert fresh._trial(1).samples == {"late": [], "early": []}
    with pytest.raises(ValueError, match="trial_steps=1"):
        EarlyDraftTuner(trial_steps=1)


def _medians_decision(late, early, min_gain):
    """The decision from whole windows, computed here from the samples: early when its
    median is at least min_gain below late's."""
    late_m, early_m = float(np.median(late)), float(np.median(early))
    return late_m, early_m, early_m <= late_m * (1.0 - min_gain)


def test_a_clear_difference_is_decided_after_the_quick_windows():
    """Default tuner: two 8-step windows (plus their switch steps) that do not overlap decide
    at once, 18 steps instead of 66; the slower path's steps are what a trial costs."""
    tuner = EarlyDraftTuner()
    assert (tuner.steps_to_decide_clearly, tuner.steps_to_decide) == (18, 68)
    rng = np.random.default_rng(0)
    late = list(1.08e-3 + rng.uniform(0, 1e-4, 100))
    early = list(0.645e-3 + rng.uniform(0, 1e-4, 100))
    seen = {"late": [], "early": []}

    def step(is_early):
        return (early if is_early else late).pop()

    paths = []
    for _ in range(40):
        e = tuner.use_early(1)
        paths.append(e)
        t = step(e)
        seen["early" if e else "late"].append(t)
        tuner.observe(1, e, t)
    assert paths == [False] * 9 + [True] * 9 + [True] * 22
    # the medians of the counted samples (each window's first step, the switch, left out)
    want = _medians_decision(seen["late"][1:9], seen["early"][1:9], tuner.min_gain)
    assert tuner.history == [(1, *want)] and want[2]
    assert tuner.settled(1) and tuner.decision(1) == "early"


@pytest.mark.parametrize("early_times", [
    # medians 3 % apart: less than clear_gain
    [0.97, 0.96, 0.98, 0.97],
    # medians 15 % apart but the windows overlap (early's upper quartile above late's lower)
    [0.5, 1.2, 0.5, 1.2],
])
def test_a_close_call_extends_both_windows_to_trial_steps(early_times):
    """Where the quick windows do not differ clearly, the tuner times trial_steps of each path
    (off again, then on, each with its switch step) and decides on the medians of all samples."""
    tuner = EarlyDraftTuner(trial_steps=20, quick_steps=4, min_gain=0.01, clear_gain=0.10)
    assert tuner.steps_to_decide == 2 * 5 + 2 * 17
    counted = {False: [], True: []}
    paths = []
    for i in range(60):
        e = tuner.use_early(2)
        paths.append(e)
        t = early_times[i % 4] if e else 1.0 + 0.001 * (i % 3)
        tuner.observe(2, e, t)
        counted[e].append(t)
    assert paths[:44] == [False] * 5 + [True] * 5 + [False] * 17 + [True] * 17
    # each window's first step is a switch: not counted
    late = counted[False][1:5] + counted[False][6:22]
    early = counted[True][1:5] + counted[True][6:22]
    want = _medians_decision(late, early, 0.01)
    assert tuner.history == [(2, *want)]
    assert paths[44:] == [want[2]] * 16


def test_the_tuner_refuses_bad_windows():
    with pytest.raises(ValueError, match="quick_steps=1"):
        EarlyDraftTuner(quick_steps=1)
    with pytest.raises(ValueError, match="clear_gain=0.005"):
        EarlyDraftTuner(min_gain=0.01, clear_gain=0.005)
    # quick windows no longer than the trial's; None: one stage of trial_steps
    assert EarlyDraftTuner(trial_steps=5).steps_to_decide == 12
    assert EarlyDraftTuner(quick_steps=None).steps_to_decide == 66


def test_the_runner_times_eligible_steps_for_the_tuner_and_follows_it(monkeypatch):
    """On the CPU "auto" is never eligible, so mode "1" with a tuner attached drives the same
    runner path: eligible steps are timed and reported with the path they took, the decision
    is followed (no early preparation once it says late), and greedy output is unchanged."""
    monkeypatch.setenv(ENV_FLAG, "1")
    spec = {"method": "dspark", "num_speculative_tokens": 4}
    with LLM(device="cpu", max_model_len=128, max_num_seqs=4, speculative_config=spec) as llm:
        speculator = llm.llm_engine.executor.worker.model_runner.speculator
        assert speculator.wants_early_draft() and speculator.early_tuner is None
        tuner = speculator.early_tuner = EarlyDraftTuner(trial_steps=2, recheck_steps=10 ** 6)
        seen, prepared = [], []
        inner_observe, inner_prepare = tuner.observe, speculator.prepare_early

        def observe(num_reqs, early, seconds):
            seen.append((num_reqs, early, seconds))
            inner_observe(num_reqs, early, seconds)

        def prepare_early(*args, **kwargs):
            prepared.append(len(seen))
            return inner_prepare(*args, **kwargs)

        tuner.observe, speculator.prepare_early = observe, prepare_early
        # the decision after the trial: late, whatever the CPU timings say
        tuner.min_gain = 0.999
        outputs = llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == generate(None, "0", monkeypatch,
                                                                       params=LONG)[0]
    assert seen and all(s > 0 for _, _, s in seen)
    # Per batch bucket: 3 late steps, 3 early ones, then late (the decision) from then on.
    by_bucket = {}
    for i, (num_reqs, early, _) in enumerate(seen):
        by_bucket.setdefault(1 << max(num_reqs - 1, 0).bit_length(), []).append((i, early))
    longest = max(by_bucket.values(), key=len)
    assert len(longest) >= 7, by_bucket
    assert [e for _, e in longest] == [False] * 3 + [True] * 3 + [False] * (len(longest) - 6)
    assert tuner.history and not any(h[3] for h in tuner.history)
    # an early preparation ran in exactly the steps timed as early
    assert sorted(prepared) == [i for i, (_, early, _) in enumerate(seen) if early]


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_device_lowering_is_asked_with_the_all_rejected_bound_and_replaces_the_host_refresh(
        plain, method, monkeypatch):
    """VLLM_EARLY_DRAFT_DEVICE_LOWERING=1: prepare_early asks every drafter group's builder to
    lower its plan on the device, giving the lower bound (every draft rejected: the verify
    step's rows advance by one token), and a proposal whose early plans were all lowered uses
    them as they are (no host refresh, no rebuild). TORCH_MLA has no such lowering; a recording
    stand-in that accepts stands in for FlashInfer's (its plans read the device lengths, which
    are exact, so the drafts must not change). On by default; "0" turns it off."""
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
    from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator
    from vllm.v1.worker.gpu.spec_decode.early_draft import (DEVICE_LOWERING_FLAG,
                                                            device_lowering_enabled)
    monkeypatch.delenv(DEVICE_LOWERING_FLAG, raising=False)
    assert device_lowering_enabled()  # on by default
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "0")
    assert not device_lowering_enabled()
    asked = []

    def lower_on_device(self, metadata, lower_seq_lens_np):
        asked.append(list(lower_seq_lens_np))
        return True

    monkeypatch.setattr(TorchMLAMetadataBuilder, "lower_decode_seq_lens_on_device",
                        lower_on_device, raising=False)
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    trace = {"prepared": [], "proposed": []}
    forwards, inside = [], [False]
    inner_block_step, inner_prepare = BlockSpeculator._block_step, BlockSpeculator.prepare_early

    def block_step(self, *args):
        forwards.append(inside[0])  # True: a draft forward inside prepare_early
        return inner_block_step(self, *args)

    def prepare_early(self, *args, **kwargs):
        inside[0] = True
        try:
            return inner_prepare(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(BlockSpeculator, "_block_step", block_step)
    monkeypatch.setattr(BlockSpeculator, "prepare_early", prepare_early)
    late_tokens, late_accepted, _ = generate(method, "0", monkeypatch)
    late_forwards = len(forwards)
    forwards.clear()
    tokens, accepted, (refreshes, rebuilds, launches) = generate(method, "1", monkeypatch,
                                                                 trace)
    # The same drafts in every step (the accepted counts), though each early draft step ran
    # before the host had the step's output: it reads only device data.
    assert tokens == late_tokens == plain and accepted == late_accepted
    assert trace["prepared"] and refreshes == rebuilds == 0
    # every lowered early step launched its draft step in prepare_early, and the proposal
    # used those drafts (no second draft forward)
    assert launches == len(trace["prepared"])
    assert forwards.count(True) == launches
    # ... and those proposals ran no second one: one draft forward per proposal, as late
    assert len(forwards) == late_forwards
    block = trace["query_len"]  # the drafter's block (tiny DSpark: block_size 4)
    # one call per prepared step: its lower bound of the new computed counts, + the block
    assert asked == [[lo + block for lo in lower] for _, _, lower in trace["prepared"]]
    for device, upper, lower in trace["prepared"]:
        # verify rows of 1 + 4 tokens: every draft rejected advances a row by one
        assert all(lo == u - 4 <= e for lo, u, e in zip(lower, upper, device))


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_a_lowered_early_step_advances_the_previous_plans_instead_of_building(
        plain, method, fused, monkeypatch):
    """With the device lowering on, an early draft step whose batch has the previous lowered
    step's rows hands that step's metadata to the builders' advance_decode_plan_on_device
    with both bounds of its lengths (every draft rejected / accepted, + the block) and, where
    every group advances, builds no draft metadata on the host. Any draft metadata built in
    between (here: the count bumped before every third step) rules the advance out. TORCH_MLA
    plans nothing, so recording stand-ins accept for FlashInfer's lowering and advance; the
    reused TORCH_MLA metadata keeps the previous step's row lengths, so the drafts may differ
    here (the GPU test compares them on FlashInfer, where the advance writes the lengths),
    while the greedy tokens must equal plain decoding's whatever was drafted."""
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
    from vllm.v1.worker.gpu.spec_decode.block_speculator import BlockSpeculator
    from vllm.v1.worker.gpu.spec_decode.early_draft import (DEVICE_LOWERING_FLAG,
                                                            FUSED_LOWERING_FLAG)
    advanced, built, bumped, calls, inside = [], [], [], [0], [False]
    late = []  # draft metadata built outside prepare_early: after which early step
    launched = []  # early steps that launched their draft step (their plans may carry on)
    rows = {}  # early step -> its batch's request count

    def lower_on_device(self, metadata, lower_seq_lens_np):
        return True

    handed = []  # per advance: what it was handed to collect the lengths' device work in

    def advance_on_device(self, metadata, bounds, fuse=None):
        lower, upper = bounds
        advanced.append((calls[0], list(lower), list(upper)))
        handed.append(fuse)
        return True

    monkeypatch.setattr(TorchMLAMetadataBuilder, "lower_decode_seq_lens_on_device",
                        lower_on_device, raising=False)
    monkeypatch.setattr(TorchMLAMetadataBuilder, "advance_decode_plan_on_device",
                        advance_on_device, raising=False)
    monkeypatch.setenv(DEVICE_LOWERING_FLAG, "1")
    monkeypatch.setenv(FUSED_LOWERING_FLAG, fused)
    inner_build, inner_prepare = BlockSpeculator._block_attn_metadata, BlockSpeculator.prepare_early

    def block_attn_metadata(self, *args, **kwargs):
        (built if inside[0] else late).append(calls[0])
        return inner_build(self, *args, **kwargs)

    def prepare_early(self, *args, **kwargs):
        calls[0] += 1
        rows[calls[0]] = args[0]
        if calls[0] % 3 == 0:  # as if another draft build ran since the previous step
            bumped.append(calls[0])
            self.draft_metadata_builds += 1
        inside[0] = True
        try:
            drafts = inner_prepare(self, *args, **kwargs)
        finally:
            inside[0] = False
        if drafts is not None:
            launched.append(calls[0])
        return drafts

    monkeypatch.setattr(BlockSpeculator, "_block_attn_metadata", block_attn_metadata)
    monkeypatch.setattr(BlockSpeculator, "prepare_early", prepare_early)
    trace = {"prepared": [], "proposed": []}
    tokens, _, _ = generate(method, "1", monkeypatch, trace)
    assert tokens == plain
    steps = list(range(1, calls[0] + 1))
    advanced_steps = [s for s, _, _ in advanced]
    # =1: asked before the input write (VLLM_FUSED_DRAFT_PLAN_LOWERING), with a collector
    # for the write's own rows (plan_lowering.FusedDraftLowering); =0: after it, without one
    assert handed
    if fused == "1":
        assert all(f is not None and f.num_reqs == rows[s]
                   for f, s in zip(handed, advanced_steps))
    else:
        assert all(f is None for f in handed)
    # a step advances the previous step's plans where that step launched its draft step,
    # the batch kept its request count (a finished request changes the rows) and no draft
    # metadata was built elsewhere since (bumped, or the late path's in a step without an
    # early preparation); it then builds nothing on the host (the stand-ins accept)
    assert advanced_steps == [s for s in steps if s - 1 in launched and s not in bumped
                              and s - 1 not in late and rows[s] == rows[s - 1]]
    assert built == [s for s in steps if s not in advanced_steps]
    assert len(bumped) >= 3 and len(advanced) >= 5
    block = trace["query_len"]
    for step, lower, upper in advanced:
        device, upper_nc, lower_nc = trace["prepared"][step - 1]
        assert lower == [lo + block for lo in lower_nc]
        assert upper == [u + block for u in upper_nc]
        assert all(lo <= d + block <= u for lo, d, u in zip(lower, device, upper))
