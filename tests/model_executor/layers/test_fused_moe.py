"""DeepSeek MoE with stacked experts: the layer against a float64 per-expert brute force (weights
given per expert under their checkpoint names), the block-aligned sort, the Triton grouped GEMM
under the interpreter, and on the GPU at DeepSeek-V3 expert width (TP8 shard)."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.model_executor.layers.fused_moe import DeepseekMoE, select_experts
from vllm.model_executor.layers.moe_kernels import fused_experts_torch, moe_align_block_size, padded_pairs_bound
from vllm.model_executor.models.weight_loading import checkpoint_tensors_of, load_named_weights
from vllm.transformers_utils.config import HFConfig

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_fused_ops_interpret_driver.py")


def _config(**overrides):
    values = dict(hidden_size=48, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
                  n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                  scoring_func="sigmoid", topk_method="noaux_tc", hidden_act="silu")
    values.update(overrides)
    return HFConfig(values)


def _checkpoint(config, gen, dtype=torch.float32):
    """Per-expert tensors under their checkpoint names (as the tiny target files hold them); the
    router stays float32 whatever `dtype` the experts get."""
    d, i, e = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(dt)

    t = {"gate.weight": rand(e, d, dt=torch.float32)}
    if config.topk_method == "noaux_tc":
        t["gate.e_score_correction_bias"] = rand(e, scale=0.1, dt=torch.float32)
    for j in range(e):
        t[f"experts.{j}.gate_proj.weight"] = rand(i, d, scale=d ** -0.5)
        t[f"experts.{j}.up_proj.weight"] = rand(i, d, scale=d ** -0.5)
        t[f"experts.{j}.down_proj.weight"] = rand(d, i, scale=i ** -0.5)
    if config.n_shared_experts:
        s = i * config.n_shared_experts
        t["shared_experts.gate_proj.weight"] = rand(s, d, scale=d ** -0.5)
        t["shared_experts.up_proj.weight"] = rand(s, d, scale=d ** -0.5)
        t["shared_experts.down_proj.weight"] = rand(d, s, scale=s ** -0.5)
    return t


def _mlp64(x, gate, up, down):
    return F.silu(x @ gate.T) * (x @ up.T) @ down.T


def _moe_float64(config, tensors, x):
    """Brute force in float64: each token through each of its chosen experts, one at a time."""
    weights, ids = select_experts(
        F.linear(x.float(), tensors["gate.weight"]), config.num_experts_per_tok, scoring_func=config.scoring_func,
        correction_bias=tensors.get("gate.e_score_correction_bias"), num_groups=config.n_group,
        topk_groups=config.topk_group, renormalize=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor)
    t64 = {k: v.double() for k, v in tensors.items()}
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(weights[t, j]) * _mlp64(x[t], t64[f"experts.{e}.gate_proj.weight"],
                                                   t64[f"experts.{e}.up_proj.weight"],
                                                   t64[f"experts.{e}.down_proj.weight"])
    if config.n_shared_experts:
        out += _mlp64(x, t64["shared_experts.gate_proj.weight"], t64["shared_experts.up_proj.weight"],
                      t64["shared_experts.down_proj.weight"])
    return out


@pytest.mark.parametrize("routing", [
    dict(),  # sigmoid + correction bias, group-limited (noaux_tc)
    dict(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
         routed_scaling_factor=1.0),
    dict(n_shared_experts=0, n_group=1, topk_group=1, num_experts_per_tok=8),  # every expert chosen
])
@pytest.mark.parametrize("num_tokens", [1, 13, 200])
def test_moe_matches_float64_per_expert_reference(routing, num_tokens):
    config = _config(**routing)
    gen = torch.Generator().manual_seed(num_tokens)
    tensors = _checkpoint(config, gen)
    moe = DeepseekMoE(config)
    load_named_weights(moe, tensors.items())  # stacked parameters from per-expert names
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got.double(), _moe_float64(config, tensors, x), rtol=1e-5, atol=1e-5)


def test_stacked_experts_export_back_to_checkpoint_names():
    config = _config()
    tensors = _checkpoint(config, torch.Generator().manual_seed(7))
    moe = DeepseekMoE(config)
    load_named_weights(moe, tensors.items())
    exported = {name: t for pname, p in moe.named_parameters() for name, t in checkpoint_tensors_of(pname, p)}
    assert set(exported) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(exported[name], t), name


def test_moe_refuses_a_missing_expert_tensor():
    config = _config()
    tensors = _checkpoint(config, torch.Generator().manual_seed(8))
    del tensors["experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight"):
        load_named_weights(DeepseekMoE(config), tensors.items())


@pytest.mark.parametrize("use_sort", [False, True])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [(1, 256, 8, 16), (7, 4, 2, 16), (300, 16, 6, 64)])
def test_align_block_size_groups_every_pair_once(num_tokens, num_experts, top_k, block_m, use_sort):
    gen = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    sorted_pairs, block_expert = moe_align_block_size(ids, num_experts, block_m, use_sort=use_sort)
    other = moe_align_block_size(ids, num_experts, block_m, use_sort=not use_sort)
    assert torch.equal(sorted_pairs, other[0]) and torch.equal(block_expert, other[1])
    num_pairs = num_tokens * top_k
    assert sorted_pairs.numel() == padded_pairs_bound(num_pairs, num_experts, block_m)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair exactly once
    flat = ids.flatten()
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        if e == num_experts:  # past the last run: only padding
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows] == e).all())
            assert rows.tolist() == sorted(rows.tolist())  # token order inside an expert


@pytest.mark.parametrize("dense", [False, True])
def test_torch_experts_chunking_is_exact(monkeypatch, dense):
    """The bounded-chunk loop gives the same result whatever the chunk size: bit for bit on the
    gather path (per-token mat-vecs), to float32 rounding on the dense path (its GEMMs block
    differently for 9 rows than for 1)."""
    from vllm.model_executor.layers import moe_kernels
    gen = torch.Generator().manual_seed(10)
    x, w13, w2 = torch.randn(9, 16, generator=gen), torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 12, generator=gen)
    ids = torch.randint(0, 4, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    whole = fused_experts_torch(x, w13, w2, weights, ids, dense=dense)
    monkeypatch.setattr(moe_kernels, "_GATHER_BUDGET", 1)  # one token per chunk
    chunked = fused_experts_torch(x, w13, w2, weights, ids, dense=dense)
    if dense:
        assert (chunked - whole).abs().max() <= 1e-6 * whole.abs().max()
    else:
        assert torch.equal(chunked, whole)


@pytest.mark.slow
@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (8, 3), (16, 2)])
def test_torch_experts_dense_and_gathered_paths_equal_float64(num_experts, top_k):
    """Both torch paths (every expert on every token with a routing mask, and the per-token
    gather) equal a float64 per-token loop, including a token that picks one expert twice and
    an unchosen expert whose output overflows (it must not leak a NaN)."""
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    t, d, i = 37, 24, 16
    x = torch.randn(t, d, generator=gen)
    w13 = torch.randn(num_experts, 2 * i, d, generator=gen) / d ** 0.5
    w2 = torch.randn(num_experts, d, i, generator=gen) / i ** 0.5
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(t)])
    ids[0, 1] = ids[0, 0]  # a repeated expert counts twice
    weights = torch.rand(t, top_k, generator=gen)
    ref = torch.zeros(t, d, dtype=torch.float64)
    for n in range(t):
        for j in range(top_k):
            e = int(ids[n, j])
            gate, up = (w13[e].double() @ x[n].double()).chunk(2)
            ref[n] += weights[n, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    for dense in (True, False):
        got = fused_experts_torch(x, w13, w2, weights, ids, dense=dense)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5), dense
    unused = sorted(set(range(num_experts)) - set(ids.flatten().tolist()))
    if unused:
        w13_big = w13.clone()
        w13_big[unused[0]] = 1e30  # its output is inf for every token
        got = fused_experts_torch(x, w13_big, w2, weights, ids, dense=True)
        assert torch.isfinite(got).all() and torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_moe_grouped_gemm_under_interpreter():
    """The Triton align + gate_up + down kernels, run by Triton's CPU interpreter, equal a float64
    brute force (several token counts, expert counts, top-k and M tiles; masked edges)."""
    run_interpreter_driver(DRIVER, ("moe",))


@pytest.fixture(scope="module")
def v3_width_moe():
    """256 experts, top-8 of 8 groups (4 kept), hidden 7168, moe_intermediate 2048 / TP8 = 256, one
    shared expert, bf16 experts and a float32 router; built once (about 3 GB of weights)."""
    config = _config(hidden_size=7168, moe_intermediate_size=256, n_routed_experts=256, num_experts_per_tok=8,
                     n_group=8, topk_group=4, routed_scaling_factor=2.5)
    tensors = _checkpoint(config, torch.Generator(device="cuda").manual_seed(11), dtype=torch.bfloat16)
    with torch.device("cuda"):
        moe = DeepseekMoE(config)
    moe = moe.to(torch.bfloat16)
    moe.gate.float()  # the router stays float32, as the model keeps it
    load_named_weights(moe, tensors.items())
    del tensors
    return moe


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_moe_triton_at_deepseek_v3_width_on_gpu(v3_width_moe, num_tokens):
    """bf16 Triton grouped GEMM against a float32 per-expert reference on the same bf16 weights.
    The forward must not sync with the host and must replay from a CUDA graph."""
    moe = v3_width_moe
    x = torch.randn(num_tokens, 7168, generator=torch.Generator().manual_seed(num_tokens)).to(torch.bfloat16).cuda()
    with torch.no_grad():
        moe(x)  # compile the kernels outside the sync check / capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        weights, ids = select_experts(moe.gate(x), 8, scoring_func="sigmoid",
                                      correction_bias=moe.gate.e_score_correction_bias, num_groups=8,
                                      topk_groups=4, renormalize=True, routed_scaling_factor=2.5)
        xf = x.float()
        ref = torch.zeros_like(xf)
        for t in range(num_tokens):
            for j in range(8):
                e = int(ids[t, j])
                w13, w2 = moe.experts.w13_weight[e].float(), moe.experts.w2_weight[e].float()
                gate, up = (w13 @ xf[t]).chunk(2)
                ref[t] += float(weights[t, j]) * (w2 @ (F.silu(gate) * up))
        sh = moe.shared_experts
        gate, up = (xf @ sh.gate_up_proj.weight.float().T).chunk(2, dim=-1)
        ref += (F.silu(gate) * up) @ sh.down_proj.weight.float().T
        assert got.dtype == torch.bfloat16
        scale = ref.abs().max().item()
        assert (got.float() - ref).abs().max().item() <= 2e-2 * scale
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = moe(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got)  # same input, deterministic kernels (no atomics)
