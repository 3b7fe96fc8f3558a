"""FLASHINFER_MLA prefill (ragged prefill wrapper, fa3, qk 192 / vo 128) on an H200 against the
float64 dense oracle, with cached context read in several passes, and under simulated DCP.
Run on the GPU node:
    source .gpu/env.sh && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    pytest -m gpu tests/v1/attention/test_mla_prefill_gpu.py -q
"""
import pytest
import torch

from tests.utils.mla_prefill_helpers import (NOPE, R, build_prefill_rank, fake_layer,
                                             make_prefill_case, reference_prefill)
from vllm.v1.attention.backends.mla import prefill as prefill_mod
from vllm.v1.attention.ops.dcp_combine import merge_attn_states

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
# bf16 inputs and K/V: FlashInfer vs the exact float64 answer (O values are O(0.5)).
O_TOL, LSE_TOL = 2e-2, 2e-2
CASES = {
    "fresh": ([0, 0], [300, 77]),
    "chunked_context": ([1000, 0, 2500, 7], [256, 130, 512, 64]),
    "long_context_short_query": ([4096], [17]),
}


@pytest.fixture(scope="module", autouse=True)
def hopper_with_flashinfer():
    pytest.importorskip("flashinfer", reason="source .gpu/env.sh first (installs flashinfer)")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FlashInfer fa3 prefill path needs an sm90 GPU")


def _builder_cls():
    from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAMetadataBuilder
    return FlashInferMLAMetadataBuilder


def _bf16_case(name, heads=16, seed=0):
    return make_prefill_case(*CASES[name], num_heads=heads, seed=seed)


def _on_gpu(case):
    q = case.q.to(DEVICE, torch.bfloat16)
    c_kv, k_pe = (t.to(DEVICE, torch.bfloat16) for t in case.new_tokens())
    return q, c_kv, k_pe, case.w_kv_b.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("chunk", [512, 8192])
@pytest.mark.parametrize("name", sorted(CASES))
def test_flashinfer_prefill_matches_float64(name, chunk):
    case = _bf16_case(name, seed=len(name))
    meta, cache = build_prefill_rank(case, chunk=chunk, block_size=64, device=DEVICE,
                                     cache_dtype=torch.bfloat16, fill=0.0,
                                     builder_cls=_builder_cls())
    assert meta.backend == "flashinfer"
    if sum(case.context_lens) > chunk:
        assert len(meta.context_chunks) > 1  # several passes, merged by LSE
    q, c_kv, k_pe, w = _on_gpu(case)
    layer = fake_layer(w, case.scale, cache)
    out = prefill_mod.forward_mla_prefill(layer, q[..., :NOPE], q[..., NOPE:], c_kv, k_pe, meta)
    ref, _ = reference_prefill(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double().cpu(), ref, rtol=O_TOL, atol=O_TOL)


def test_flashinfer_lse_is_converted_to_natural_log():
    case = _bf16_case("chunked_context", seed=5)
    meta, cache = build_prefill_rank(case, chunk=1024, block_size=64, device=DEVICE,
                                     cache_dtype=torch.bfloat16, fill=0.0,
                                     builder_cls=_builder_cls())
    q, c_kv, k_pe, w = _on_gpu(case)
    k, v = prefill_mod.expand_latent(c_kv, k_pe, w, NOPE)
    o_s, l_s = prefill_mod.self_attention_flashinfer(q, k, v, meta, case.scale)
    o_c, l_c = prefill_mod.context_attention_flashinfer(q, cache, w, meta, case.scale, R, NOPE)
    out, lse = merge_attn_states(torch.stack([o_s.float(), o_c.float()]),
                                 torch.stack([l_s, l_c]))
    ref, ref_lse = reference_prefill(case)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=O_TOL, atol=O_TOL)


def test_torch_prefill_on_gpu_matches_float64():
    case = _bf16_case("chunked_context", seed=6)
    meta, cache = build_prefill_rank(case, chunk=700, block_size=64, device=DEVICE,
                                     cache_dtype=torch.bfloat16, fill=0.0)
    assert meta.backend == "torch"
    q, c_kv, k_pe, w = _on_gpu(case)
    out = prefill_mod.forward_mla_prefill(fake_layer(w, case.scale, cache), q[..., :NOPE],
                                          q[..., NOPE:], c_kv, k_pe, meta)
    torch.testing.assert_close(out.double().cpu(), reference_prefill(case)[0], rtol=O_TOL,
                               atol=O_TOL)


@pytest.mark.parametrize("n,interleave", [(2, 1), (4, 4), (8, 1)])
def test_flashinfer_dcp_context_shards_merge_to_the_oracle(n, interleave):
    case = _bf16_case("chunked_context", seed=n)
    q, c_kv, k_pe, w = _on_gpu(case)
    k, v = prefill_mod.expand_latent(c_kv, k_pe, w, NOPE)
    outs, lses = [], []
    for rank in range(n):
        meta, cache = build_prefill_rank(case, n=n, rank=rank, interleave=interleave,
                                         chunk=600, block_size=64, device=DEVICE,
                                         cache_dtype=torch.bfloat16, fill=0.0,
                                         builder_cls=_builder_cls())
        o, l = prefill_mod.context_attention_flashinfer(q, cache, w, meta, case.scale, R, NOPE)
        outs.append(o.float())
        lses.append(l)
        if rank == 0:
            o_s, l_s = prefill_mod.self_attention_flashinfer(q, k, v, meta, case.scale)
    o_ctx, l_ctx = merge_attn_states(torch.stack(outs), torch.stack(lses))
    out, _ = merge_attn_states(torch.stack([o_s.float(), o_ctx]), torch.stack([l_s, l_ctx]))
    torch.testing.assert_close(out.double().cpu(), reference_prefill(case)[0], rtol=O_TOL,
                               atol=O_TOL)
