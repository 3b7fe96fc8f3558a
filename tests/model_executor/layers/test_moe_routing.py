"""vllm/model_executor/layers/moe_routing.py: the MoE's routing and pair alignment as one Triton
kernel each equal the torch forms (fused_moe.select_experts, moe_align_block_size): under
Triton's CPU interpreter, and on the GPU at DeepSeek-V3 router width, where the MoE layer with
them runs without a host sync, replays from a CUDA graph, and equals the layer without them."""
from pathlib import Path

import pytest
import torch

from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.model_executor.layers import moe_routing
from vllm.model_executor.layers.fused_moe import DeepseekMoE, select_experts
from vllm.model_executor.layers.moe_kernels import moe_align_block_size
from vllm.transformers_utils.config import HFConfig

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_moe_routing_interpret_driver.py")


def test_routing_and_alignment_kernels_under_interpreter():
    """Six routers (the tiny model's, groups of two, DeepSeek-V3's 256 experts in 8 groups, a
    softmax router over 6 experts, top-1, every expert chosen) at 1, 5 and 33 tokens: the same
    experts in the same order, weights to float32 rounding; the alignment equal bit for bit
    for spread and skewed ids, from one pair to 600."""
    run_interpreter_driver(DRIVER)


@pytest.mark.parametrize("experts,top_k,groups,kept,scoring,fits", [
    (4, 2, 1, 1, "sigmoid", True),
    (256, 8, 8, 4, "sigmoid", True),
    (160, 6, 8, 3, "softmax", False),   # DeepSeek-V2: groups of 20 are not a power of two
    (64, 6, 3, 1, "sigmoid", False),    # 3 groups
    (8, 2, 1, 1, "tanh", False),        # no such scoring function
])
def test_which_routers_the_kernel_serves(experts, top_k, groups, kept, scoring, fits):
    assert moe_routing.route_supported(experts, top_k, groups, kept, scoring) is fits


def test_which_batches_the_alignment_kernel_serves():
    # the expert chunk shrinks as pairs grow; past one program's cells or four chunks of
    # experts the torch form stays (at 256 pairs over 256 experts the kernel was slower)
    assert moe_routing.align_supported(5 * 2, 4, 16)         # tiny model, B=1 verify
    assert moe_routing.align_supported(1024, 4, 16)          # tiny model, 512 tokens
    assert moe_routing.align_supported(5 * 8, 256, 16)       # V3 router, B=1 verify
    assert not moe_routing.align_supported(32 * 8, 256, 16)  # V3 router, B=32 decode
    assert not moe_routing.align_supported(8192 * 8, 256, 64)  # a prefill chunk
    assert not moe_routing.align_supported(0, 4, 16)


def test_prefill_sized_calls_keep_the_torch_routing(monkeypatch):
    """The layer routes a CUDA call of up to MAX_ROUTE_TOKENS tokens with the kernel and a
    longer one (a prefill) with select_experts, so a prefill's temporaries and the memory
    profile stay the torch form's; off CUDA, with the switch off or for a router the kernel
    does not serve, always the torch form."""
    from types import SimpleNamespace

    from vllm.model_executor.layers import fused_moe
    monkeypatch.setattr(fused_moe, "HAS_TRITON", True)
    monkeypatch.setenv(moe_routing.ENV_FLAG, "1")
    limit = moe_routing.MAX_ROUTE_TOKENS

    def call(tokens, cuda=True):
        return SimpleNamespace(is_cuda=cuda, shape=(tokens, 64))

    layer = DeepseekMoE(_config(n_routed_experts=4, n_group=1, topk_group=1))
    assert [layer.routes_fused(call(n)) for n in (1, 5, limit, limit + 1, 8192)] == [
        True, True, True, False, False]
    assert not layer.routes_fused(call(5, cuda=False))
    layer.fused_routing = False
    assert not layer.routes_fused(call(5))
    odd = DeepseekMoE(_config(n_routed_experts=12, n_group=3, topk_group=1))  # groups of 4, 3
    assert not odd.routes_fused(call(5))


def _config(**overrides):
    values = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
                  topk_method="noaux_tc", hidden_act="silu")
    values.update(overrides)
    return HFConfig(values)


def test_the_switch_is_read_when_a_layer_is_built(monkeypatch):
    monkeypatch.setenv(moe_routing.ENV_FLAG, "0")
    assert DeepseekMoE(_config()).fused_routing is False
    monkeypatch.setenv(moe_routing.ENV_FLAG, "1")
    assert DeepseekMoE(_config()).fused_routing is True
    monkeypatch.setenv(moe_routing.ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=r"VLLM_FUSED_MOE_ROUTING='yes' is invalid"):
        DeepseekMoE(_config())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5, 40, 64])
def test_routing_kernels_on_the_gpu_at_deepseek_v3_width(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 256, device="cuda", generator=gen) * 3
    bias = torch.randn(256, device="cuda", generator=gen) * 0.2
    kwargs = dict(scoring_func="sigmoid", correction_bias=bias, num_groups=8, topk_groups=4,
                  renormalize=True, routed_scaling_factor=2.5)
    ref_w, ref_ids = select_experts(logits, 8, **kwargs)
    got_w, got_ids = moe_routing.route_triton(logits, 8, **kwargs)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)
    for block_m in (16, 64):
        if moe_routing.align_supported(num_tokens * 8, 256, block_m):
            ref = moe_align_block_size(ref_ids, 256, block_m)
            got = moe_routing.align_triton(ref_ids, 256, block_m)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_moe_layer_with_the_kernels_equals_it_without_them_and_replays(monkeypatch, dtype):
    """The tiny model's router shape (4 experts, top-2, one group) and a grouped one: the layer
    built with the kernels against the same weights without them (equal experts, so outputs to
    the weights' float32 rounding), with no host sync, and a CUDA graph replay of it equal to
    its eager call."""
    for overrides in (dict(n_routed_experts=4, n_group=1, topk_group=1),
                      dict(n_routed_experts=8, n_group=4, topk_group=2)):
        config = _config(**overrides)
        layers = {}
        for flag in ("0", "1"):
            monkeypatch.setenv(moe_routing.ENV_FLAG, flag)
            torch.manual_seed(3)
            with torch.device("cuda"):
                layer = DeepseekMoE(config)
            for p in layer.parameters():
                p.data.normal_(0, 0.2)
            layer.experts.to(dtype)
            if layer.shared_experts is not None:
                layer.shared_experts.to(dtype)
            layers[flag] = layer
        x = torch.randn(5, config.hidden_size, device="cuda").to(dtype)
        with torch.no_grad():
            ref = layers["0"](x)
            layers["1"](x)  # compile outside the checks
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = layers["1"](x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2,
                                                                                   atol=2e-2)
            torch.testing.assert_close(got, ref, **tol)
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                layers["1"](static)
                with torch.cuda.graph(graph, stream=stream):
                    captured = layers["1"](static)
            torch.cuda.current_stream().wait_stream(stream)
            static.copy_(x * 0.5)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, layers["1"](x * 0.5))
