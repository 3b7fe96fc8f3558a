"""vllm/v1/worker/gpu/spec_decode/dspark/markov_greedy.py: DSpark's greedy draft chain through
its Markov head as one Triton kernel chooses what the speculator's torch ops choose: under
Triton's CPU interpreter, compiled for sm_90, and on the GPU at the tiny model's head, where it
also replays from a CUDA graph; and the speculator uses it only where it should."""
from pathlib import Path

import pytest
import torch

from tests.utils.markov_drafts_reference import greedy_gap_bounds, greedy_gaps, torch_chain
from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.v1.worker.gpu.spec_decode.dspark import markov_greedy

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_markov_greedy_interpret_driver.py")


def test_markov_greedy_kernel_under_interpreter():
    """float32: the torch form's drafts exactly, for 1-8 rows, 1-8 positions, vocabularies of
    17-1000 and ranks of 5-256; bf16: the torch form's drafts but for last-bit near-ties, and a
    greedy choice everywhere; exact ties take the first index, also across W2 tiles; logits
    may be a view of wider rows."""
    run_interpreter_driver(DRIVER)


def test_which_heads_and_steps_the_kernel_serves():
    assert markov_greedy.markov_greedy_supported(260, 64)      # the tiny model's head
    assert markov_greedy.markov_greedy_supported(256, 256)
    assert not markov_greedy.markov_greedy_supported(129280, 64)  # a real vocabulary
    assert not markov_greedy.markov_greedy_supported(64, 512)     # rank past the bound
    assert not markov_greedy.markov_greedy_supported(64, 0)
    use = markov_greedy.uses_fused_markov
    assert use(True, "cuda", True, 260, 64)
    assert not use(False, "cuda", True, 260, 64)   # switched off
    assert not use(True, "cpu", True, 260, 64)     # the CPU keeps the torch ops
    assert not use(True, "cuda", False, 260, 64)   # probabilistic drafting keeps q
    assert not use(True, "cuda", True, 129280, 64)


def test_a_head_that_does_not_match_the_logits_is_refused():
    logits = torch.zeros(1, 2, 10)
    with pytest.raises(ValueError, match=r"do not match logits of vocabulary 10"):
        markov_greedy.markov_greedy_drafts(logits, torch.zeros(1, dtype=torch.long),
                                           torch.zeros(12, 4), torch.zeros(12, 4))


def test_the_switch_is_read_when_the_speculator_is_built(monkeypatch):
    from vllm import LLM
    spec = {"method": "dspark", "num_speculative_tokens": 4}
    for flag, expected in ((None, True), ("0", False), ("1", True)):  # on by default
        if flag is None:
            monkeypatch.delenv(markov_greedy.ENV_FLAG, raising=False)
        else:
            monkeypatch.setenv(markov_greedy.ENV_FLAG, flag)
        with LLM(device="cpu", max_model_len=64, max_num_seqs=2, speculative_config=spec) as llm:
            speculator = llm.llm_engine.executor.worker.model_runner.speculator
            assert speculator.fused_markov is expected
    monkeypatch.setenv(markov_greedy.ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=r"VLLM_FUSED_MARKOV_DRAFTS='yes' is invalid"):
        markov_greedy.fused_markov_enabled()


def test_markov_greedy_kernel_compiles_for_sm90():
    """The launches of the interpreter's shapes (tiny head, k=4; several tiles, k=8; bf16)."""
    pytest.importorskip("triton")
    from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches
    cuda_target()
    with record_launches(markov_greedy, "_markov_greedy_kernel") as rec:
        for rows, k, vocab, rank, dtype in ((1, 4, 260, 64, torch.bfloat16),
                                            (8, 4, 260, 64, torch.float32),
                                            (5, 8, 1000, 32, torch.bfloat16)):
            markov_greedy.markov_greedy_drafts(torch.zeros(rows, k, vocab, dtype=dtype),
                                               torch.zeros(rows, dtype=torch.long),
                                               torch.zeros(vocab, rank, dtype=dtype),
                                               torch.zeros(vocab, rank, dtype=dtype))
    compile_recorded(rec, expect_at_least=3)


def _tiny_head_case(rows: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vocab, rank, k = 260, 64, 4
    logits = (torch.randn(rows, k, vocab, device="cuda", generator=gen) * 2).to(dtype)
    w1 = (torch.randn(vocab, rank, device="cuda", generator=gen) / 8).to(dtype)
    w2 = torch.randn(vocab, rank, device="cuda", generator=gen).to(dtype)
    anchors = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    return logits, anchors, w1, w2


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_the_kernel_chooses_the_torch_drafts_on_the_gpu_and_replays(rows):
    """The tiny model's head in bf16 (cuBLAS's GEMV and argmax on the other side): the same
    drafts but for last-bit near-ties, and a greedy choice at every position; no host sync; a
    CUDA graph of the launch replays to the eager result on new inputs."""
    markov_greedy.markov_greedy_drafts(*_tiny_head_case(rows, 99))  # compiled before the checks
    same = 0
    for seed in range(8):
        logits, anchors, w1, w2 = _tiny_head_case(rows, seed)
        ref = torch_chain(logits, anchors, w1, w2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        same += int((got == ref).all(dim=1).sum())
        # (a fixed 2e-2 failed at B=64 on an H100 with 0.0219: one bf16 ulp at |logit| ~ 5)
        gaps = greedy_gaps(got, logits, anchors, w1, w2)
        assert bool((gaps <= greedy_gap_bounds(got, logits, anchors, w1, w2)).all()), seed
    assert same >= 8 * rows - max(2, rows // 8), (same, 8 * rows)
    logits, anchors, w1, w2 = _tiny_head_case(rows, 100)
    markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)
    fresh = _tiny_head_case(rows, 101)
    logits.copy_(fresh[0])
    anchors.copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2))


@pytest.mark.gpu
def test_dspark_greedy_tokens_and_acceptance_with_and_without_the_kernel(monkeypatch):
    """The DSpark engine (CUDA graphs; TORCH_MLA in float32, where greedy speculative tokens
    must equal plain decoding's exactly) with the kernel and with the torch ops: the same
    greedy tokens as plain decoding, and mean acceptance lengths that only near-tie drafts
    could separate (within 2 %)."""
    from vllm import LLM, SamplingParams
    prompts = [[(7 * i + 13 * j) % 200 + 30 for j in range(12 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens, acceptance = {}, {}
    for flag in ("0", "1", None):
        monkeypatch.setenv(markov_greedy.ENV_FLAG, flag or "1")
        spec = None if flag is None else {"method": "dspark", "num_speculative_tokens": 4}
        with LLM(max_model_len=128, max_num_seqs=4, dtype="float32",
                 attention_backend="TORCH_MLA", speculative_config=spec) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[flag] = [list(o.outputs[0].token_ids) for o in outputs]
            if spec:
                engine = llm.llm_engine
                assert engine.executor.worker.model_runner.speculator.fused_markov is (
                    flag == "1")
                acceptance[flag] = engine.scheduler.get_stats()["spec_decode"][
                    "mean_acceptance_length"]
    assert tokens["0"] == tokens[None] and tokens["1"] == tokens[None]
    assert acceptance["1"] == pytest.approx(acceptance["0"], rel=0.02), acceptance
