"""TP=2 over gloo (two processes): same logits as TP=1 and the Hugging Face oracle, weights really
split; and TP=2 with DCP=2: the KV cache is sharded over the two ranks, decode goes through the
q all-gather + LSE merge, logits unchanged."""
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.utils.paged_harness import PagedRequest, PagedRunner, hf_logits
from tests.utils.tp_worker import run_rank
from vllm.model_executor.model_loader import iterate_safetensors
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.tiny import write_random_target
from vllm.transformers_utils.config import load_hf_config
from vllm.forward_context import dense_attention_context

PROMPT_A = [(11 * i * i + 5 * i + 3) % 256 for i in range(22)]
PROMPT_B = [(13 * i + 40) % 256 for i in range(13)]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model_dir = str(root / "model")
    write_random_target(model_dir, seed=11)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(r, 2, model_dir, str(root / "rdv"), str(root), PROMPT_A, PROMPT_B))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    single = DeepseekV3ForCausalLM(hf_config=load_hf_config(model_dir))
    single.load_weights(iterate_safetensors(model_dir))
    with torch.no_grad(), dense_attention_context():
        tp1 = single.compute_logits(single(torch.tensor(PROMPT_A), torch.arange(len(PROMPT_A))))
    runner = PagedRunner(single, block_size=4, num_blocks=32)
    tp1_a, tp1_b = runner.run([PagedRequest(PROMPT_A, chunks=[8, 1, 1, 3, 1, 2, 1, 5]),
                               PagedRequest(PROMPT_B, chunks=[5, 1, 4, 1, 2], start_step=2)])
    return dict(ranks=ranks, model_dir=model_dir, single=single, tp1=tp1, tp1_a=tp1_a, tp1_b=tp1_b,
                hf_a=hf_logits(model_dir, PROMPT_A), hf_b=hf_logits(model_dir, PROMPT_B))


def _close(a, b):
    rel = (a - b).abs().max().item() / b.abs().max().item()
    assert rel <= 1e-4, rel


@pytest.mark.slow
@pytest.mark.parametrize("dcp", [1, 2])
def test_tp2_logits_match_tp1_and_hf(tp_results, dcp):
    for rank in tp_results["ranks"]:
        out = rank[dcp]
        _close(out["prefill"], tp_results["tp1"])
        _close(out["prefill"], tp_results["hf_a"])
        _close(out["paged_a"], tp_results["tp1_a"])
        _close(out["paged_b"], tp_results["tp1_b"])
        _close(out["paged_a"], tp_results["hf_a"])
        _close(out["paged_b"], tp_results["hf_b"])


@pytest.mark.slow
def test_tp2_weights_are_split(tp_results):
    single_shapes = {n: tuple(p.shape) for n, p in tp_results["single"].named_parameters()}
    single_bytes = sum(p.numel() * p.element_size() for p in tp_results["single"].parameters())
    r0, r1 = (r[1] for r in tp_results["ranks"])
    shapes = r0["param_shapes"]
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"][0] * 2 == single_shapes["model.layers.0.self_attn.kv_b_proj.weight"][0]
    assert shapes["model.layers.0.self_attn.o_proj.weight"][1] * 2 == single_shapes["model.layers.0.self_attn.o_proj.weight"][1]
    experts_w2 = "model.layers.1.mlp.experts.w2_weight"  # [E, D, I_local]
    assert shapes[experts_w2][2] * 2 == single_shapes[experts_w2][2]
    experts_w13 = "model.layers.1.mlp.experts.w13_weight"  # [E, 2 * I_local, D]
    assert shapes[experts_w13][1] * 2 == single_shapes[experts_w13][1]
    assert shapes["lm_head.weight"][0] * 2 == single_shapes["lm_head.weight"][0]
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == single_shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    # per-rank parameter memory: everything but the small replicated projections is halved
    assert r0["param_bytes"] < 0.62 * single_bytes and r1["param_bytes"] < 0.62 * single_bytes
    full = load_file(os.path.join(tp_results["model_dir"], "model.safetensors"))["model.layers.0.self_attn.q_b_proj.weight"]
    half = full.shape[0] // 2
    torch.testing.assert_close(r0["q_b_proj"], full[:half], rtol=0, atol=0)
    torch.testing.assert_close(r1["q_b_proj"], full[half:], rtol=0, atol=0)


@pytest.mark.slow
def test_dcp2_shards_the_kv_cache(tp_results):
    """With DCP=2 each rank stores only its tokens (I=1: alternate positions), together all."""
    total = len(PROMPT_A) + len(PROMPT_B)
    stored = [r[2]["stored_tokens"] for r in tp_results["ranks"]]
    assert sum(stored) == total
    assert stored == [(len(PROMPT_A) + 1) // 2 + (len(PROMPT_B) + 1) // 2, len(PROMPT_A) // 2 + len(PROMPT_B) // 2]
    assert all(r[1]["stored_tokens"] == total for r in tp_results["ranks"])
