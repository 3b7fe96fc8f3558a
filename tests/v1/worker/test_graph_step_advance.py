"""Graph steps carry the previous graph step's attention metadata over (the runner's
`_advance_graph_step`, the builders' `advance_graph_step`), on the CPU.

The CPU engine captures no graphs, so these tests lay out every uniform decode step as a graph
step does (graph-shaped metadata: no padding, the capture's max_seq_len bound) and run its
forward eagerly, as the capture itself runs it. TORCH_MLA reads each query row's visible KV
count from the persistent row buffer that the advance rewrites from the device lengths, so a
wrong or stale advance changes what the target attends to, hence its tokens and its
acceptances. Oracles: plain greedy decoding, and the same engine with every step built on the
host (VLLM_GRAPH_STEP_ADVANCE=0), token for token and acceptance for acceptance."""
from __future__ import annotations

import pytest

from tests.utils.call_probes import check_switch, count_calls, record_accepted
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu.attn_utils import GRAPH_STEP_ADVANCE_FLAG, graph_step_advance_enabled
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

PROMPTS = [[(5 * i + 11 * j) % 180 + 20 for j in range(9 + 6 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _graph_shaped_steps(monkeypatch) -> None:
    """Every uniform decode step (all rows Q tokens, all sampling, ids from the device state)
    gets graph-shaped metadata and runs eagerly; others are built as before."""
    inner = GPUModelRunner._build_batch

    def build(self, layout, num_reqs_padded, cudagraph, advance=True):
        _, counts, _, samples, host_ids = layout
        n = len(counts)
        uniform = (n and counts.count(counts[0]) == n and samples.count(True) == n
                   and host_ids.count(None) == n)
        if cudagraph or not uniform:
            return inner(self, layout, num_reqs_padded, cudagraph, advance)
        batch = inner(self, layout, n, True, advance)
        batch.cudagraph = False  # no captured graph on the CPU: the capture's eager forward
        return batch

    monkeypatch.setattr(GPUModelRunner, "_build_batch", build)


def _generate(method, advance: str, monkeypatch):
    monkeypatch.setenv(GRAPH_STEP_ADVANCE_FLAG, advance)
    spec = None if method is None else {"method": method, "num_speculative_tokens": 4}
    with LLM(device="cpu", max_model_len=128, max_num_seqs=4, speculative_config=spec) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        accepted = record_accepted(runner)  # synchronous (speculative) steps
        steps = count_calls(runner, "_prepare_inputs")  # every step
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outputs], accepted,
                runner.graph_step_advances, steps[0])


@pytest.fixture(scope="module")
def plain_tokens():
    monkeypatch = pytest.MonkeyPatch()
    try:
        return _generate(None, "0", monkeypatch)[0]
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("method", [None, "dspark", "eagle"])
def test_advanced_graph_steps_equal_built_ones(method, plain_tokens, monkeypatch):
    _graph_shaped_steps(monkeypatch)
    built_tokens, built_accepted, no_advances, _ = _generate(method, "0", monkeypatch)
    tokens, accepted, advances, steps = _generate(method, "1", monkeypatch)
    assert no_advances == 0
    assert tokens == built_tokens == plain_tokens
    assert accepted == built_accepted
    if method == "eagle":
        # EAGLE's draft steps build on the target's group builders every step: no graph step
        # finds its builders untouched, so none advances (and none may).
        assert advances == 0
    else:
        # plain: every step but a block-crossing or row-changing one; DSpark: fewer (the
        # verify rows grow by up to 1 + k tokens a step)
        assert 0 < advances < steps
        if method is None:
            assert advances >= steps // 2


def test_a_step_whose_rows_changed_is_built(monkeypatch):
    """The held metadata is only for the same slots in the same rows: a step after a request
    finished (fewer rows) or with the rows in another order builds."""
    _graph_shaped_steps(monkeypatch)
    monkeypatch.setenv(GRAPH_STEP_ADVANCE_FLAG, "1")
    with LLM(device="cpu", max_model_len=128, max_num_seqs=4) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        seen = []  # (rows of the step, whether it advanced)
        inner = runner._advance_graph_step

        def advance(batch):
            held = runner._held_graph_step
            ok = inner(batch)
            seen.append((None if held is None else list(held[1]),
                         list(batch.idx_mapping_np[:batch.num_reqs]), ok))
            return ok

        runner._advance_graph_step = advance
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in (12, 30, 30)]
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert any(ok for _, _, ok in seen)
    for held_rows, rows, ok in seen:
        if held_rows != rows:
            assert not ok
    # the first request finished after 12 tokens: the next step had two rows and built
    assert any(held is not None and len(rows) < len(held) and not ok
               for held, rows, ok in seen)


def test_the_switch(monkeypatch):
    """On by default since its GPU tests passed (test_flashinfer_mla_gpu.py)."""
    check_switch(monkeypatch, GRAPH_STEP_ADVANCE_FLAG, graph_step_advance_enabled, default=True)
