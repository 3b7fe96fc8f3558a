"""The block drafters' draft step prepared while the verify step runs (early_draft.py), on the
CPU (tiny model, TORCH_MLA, eager, float32) with VLLM_EARLY_DRAFT_METADATA=1.

Oracles: the same engine with the early path off (drafts, hence per-step acceptances, must be
identical: a wrong device-side length would change the drafts but not the greedy output) and
plain greedy decoding; and, step by step, the host's exact new computed counts against the
device counts the runner derived before it had them."""
from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.spec_decode.early_draft import ENV_FLAG, early_draft_mode

PROMPTS = [[(7 * i + 13 * j) % 200 + 20 for j in range(10 + 7 * i)] for i in range(3)]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(method: str | None, mode: str, monkeypatch, trace: dict | None = None):
    monkeypatch.setenv(ENV_FLAG, mode)
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4}
    with LLM(device="cpu", max_model_len=128, max_num_seqs=4, speculative_config=spec) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        accepted_per_step = []
        inner_execute = runner.execute_model

        def execute_model(scheduler_output):
            out = inner_execute(scheduler_output)
            accepted_per_step.append(sorted(zip(out.req_ids, out.num_accepted_tokens or [])))
            return out

        runner.execute_model = execute_model
        speculator = runner.speculator
        if trace is not None:
            inner_prepare, inner_propose = speculator.prepare_early, speculator.propose

            def prepare_early(num_reqs, accepted, next_ids, upper, target):
                trace["prepared"].append((accepted[:num_reqs].tolist(), list(upper[:num_reqs])))
                return inner_prepare(num_reqs, accepted, next_ids, upper, target)

            def propose(inputs):
                early = speculator.__dict__.get("_early")
                exact = [int(v) for v in inputs.num_computed_new[:inputs.num_reqs]]
                trace["proposed"].append((early is not None, exact))
                return inner_propose(inputs)

            speculator.prepare_early, speculator.propose = prepare_early, propose
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        counts = (None if speculator is None
                  else (speculator.early_refreshes, speculator.early_rebuilds))
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
    tokens, accepted, (refreshes, rebuilds) = generate(method, "1", monkeypatch, trace)
    late_tokens, late_accepted, late_counts = generate(method, "0", monkeypatch)
    assert tokens == late_tokens == plain
    assert accepted == late_accepted  # the same drafts in every step
    assert late_counts == (0, 0)
    # Every proposal that found an early draft step pairs with the prepare_early before it:
    # the device's new computed counts are the host's exact ones, the planners' bound above.
    early_steps = [exact for early, exact in trace["proposed"] if early]
    assert len(early_steps) == len(trace["prepared"]) >= MAX_TOKENS // 4
    lowered = 0
    for (device, upper), exact in zip(trace["prepared"], early_steps):
        assert device == exact
        assert all(u >= e for u, e in zip(upper, exact))
        lowered += any(u > e for u, e in zip(upper, exact))
    assert lowered > 0  # some drafts were rejected: the bound had to be lowered
    # TORCH_MLA cannot lower planned lengths in place: every early step was built again
    assert refreshes == 0 and rebuilds == len(early_steps)


def test_auto_leaves_eager_cpu_engines_alone(monkeypatch):
    """"auto" prepares early only with a captured draft step and builders that lower lengths
    in place (FlashInfer MLA); an eager CPU engine has neither."""
    trace = {"prepared": [], "proposed": []}
    tokens, _, counts = generate("dspark", "auto", monkeypatch, trace)
    assert trace["prepared"] == [] and counts == (0, 0)
    assert len(tokens) == len(PROMPTS)


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=ENV_FLAG):
        early_draft_mode()


def test_off_unless_asked_for(monkeypatch):
    """Measured slower on the tiny model (early_draft.py), so the default is "0"."""
    monkeypatch.delenv(ENV_FLAG, raising=False)
    assert early_draft_mode() == "0"
