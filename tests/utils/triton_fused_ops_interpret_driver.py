"""Runs the fused decode-path Triton kernels (RMSNorm +- residual, RoPE, MLA rope + KV-cache write,
MoE grouped GEMM) on CPU tensors under TRITON_INTERPRET=1 and compares them with the torch paths.
Launched in a subprocess by the tests (the interpreter must be chosen before the kernels are
decorated); the arguments name the checks to run (default: all)."""
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from vllm.model_executor.layers import layernorm, moe_kernels, rotary_embedding  # noqa: E402
from vllm.v1.attention.ops import mla_kv_cache  # noqa: E402

# One bf16 ulp near 1 is 2^-8: kernel and torch may round a float32 value that sits on a bf16
# rounding boundary differently (different float32 summation order / fused multiply-add).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def check_rms_norm(gen):
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (64, 96, 512, 1536):
            for with_residual in (False, True):
                rows = int(torch.randint(1, 9, (1,), generator=gen))
                # a strided view, as kv_c is a slice of the kv_a projection output
                base = torch.randn(rows, hidden + 64, generator=gen).to(dtype)
                x = base[:, :hidden]
                w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
                res = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
                ref = layernorm.rms_norm_torch(x, w, 1e-6, res)
                got = layernorm.rms_norm_triton(x, w, 1e-6, res)
                if with_residual:
                    # one rounding of the float32 sum, like torch: exact in float32; for bf16 the
                    # interpreter truncates on float32 -> bf16 casts (the GPU rounds to nearest
                    # even; the gpu test checks bf16 exactly), so allow one bf16 ulp here
                    if dtype == torch.float32:
                        assert torch.equal(ref[1], got[1]), (dtype, hidden)
                    else:
                        torch.testing.assert_close(got[1], ref[1], rtol=2 ** -7, atol=0)
                    ref, got = ref[0], got[0]
                assert got.dtype == ref.dtype and got.shape == ref.shape
                torch.testing.assert_close(got, ref, **TOL[dtype])
    # the sum written into a column slice of a wider buffer (the target's tapped streams)
    x, r = torch.randn(6, 96, generator=gen), torch.randn(6, 96, generator=gen)
    buf = torch.zeros(6, 3 * 96)
    out, summed = layernorm.rms_norm_triton(x, torch.ones(96), 1e-6, r, sum_out=buf[:, 96:192])
    assert summed.data_ptr() == buf[:, 96:192].data_ptr() and torch.equal(buf[:, 96:192], x + r)
    assert not buf[:, :96].any() and not buf[:, 192:].any()
    torch.testing.assert_close(out, layernorm.rms_norm_torch(x, torch.ones(96), 1e-6, r)[0],
                               **TOL[torch.float32])


def _tables(max_pos, half, gen):
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * 1.3, angles.sin() * 1.3


def check_rope(gen):
    for dtype in (torch.float32, torch.bfloat16):
        for interleaved in (True, False):
            for heads in (0, 1, 3, 16):
                d, tokens = 64, int(torch.randint(1, 7, (1,), generator=gen))
                cos, sin = _tables(100, d // 2, gen)
                pos = torch.randint(0, 100, (tokens,), generator=gen)
                q = torch.randn(tokens, heads, 128 + d, generator=gen).to(dtype)[..., 128:]  # a view
                k = torch.randn(tokens, 512 + d, generator=gen).to(dtype)[:, 512:]
                qr, kr = rotary_embedding.rope_triton(pos, q, k, cos, sin, interleaved)
                qt = rotary_embedding.rope_torch(q, cos[pos][:, None], sin[pos][:, None], interleaved)
                kt = rotary_embedding.rope_torch(k, cos[pos], sin[pos], interleaved)
                torch.testing.assert_close(qr, qt, **TOL[dtype])
                torch.testing.assert_close(kr, kt, **TOL[dtype])


def check_kv_cache(gen):
    for dtype in (torch.float32, torch.bfloat16):
        for interleaved in (True, False):
            tokens, heads, blocks, bs = 7, 5, 4, 4
            kv_c = torch.randn(tokens, 512, generator=gen).to(dtype)
            latent = torch.randn(tokens, 576, generator=gen).to(dtype)
            k_pe = latent[:, 512:]  # strided, as from the kv_a split
            q_pe = torch.randn(tokens, heads, 64, generator=gen).to(dtype)
            cos, sin = _tables(64, 32, gen)
            pos = torch.randint(0, 64, (tokens,), generator=gen)
            # -1 (PAD) in the middle, and only 6 slots for 7 tokens (the last token is not stored)
            slots = torch.tensor([3, -1, 9, 0, -1, 15], dtype=torch.int64)
            # plain write
            ref = torch.full((blocks, bs, 576), 7.0).to(dtype)
            got = ref.clone()
            mla_kv_cache._concat_and_cache_torch(kv_c[:6], k_pe[:6], ref, slots)
            mla_kv_cache._launch(6, kv_c=kv_c, k_pe=k_pe, kv_cache=got, slot_mapping=slots)
            assert torch.equal(ref, got), "concat_and_cache_mla"
            # fused rope + write
            ref = torch.full((blocks, bs, 576), 7.0).to(dtype)
            got = ref.clone()
            k_out = torch.empty(tokens, 64, dtype=dtype)
            q_out = torch.empty_like(q_pe)
            mla_kv_cache._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=got, slot_mapping=slots, positions=pos,
                                 cos_cache=cos, sin_cache=sin, interleaved=interleaved, q_pe=q_pe, q_out=q_out,
                                 k_out=k_out)
            k_ref = rotary_embedding.rope_torch(k_pe, cos[pos], sin[pos], interleaved)
            q_ref = rotary_embedding.rope_torch(q_pe, cos[pos][:, None], sin[pos][:, None], interleaved)
            torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
            torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
            # the cache holds exactly the kernel's own rotated k_pe (what rotated_latent_kv returns)
            mla_kv_cache._concat_and_cache_torch(kv_c[:6], k_out[:6], ref, slots)
            assert torch.equal(ref, got), "rope_concat_and_cache_mla cache rows"
            # rope only (kv_cache None): same k values
            k_only = torch.empty(tokens, 64, dtype=dtype)
            mla_kv_cache._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=None, slot_mapping=None, positions=pos,
                                 cos_cache=cos, sin_cache=sin, interleaved=interleaved,
                                 q_pe=q_pe[:, :0], q_out=q_out[:, :0], k_out=k_only)
            assert torch.equal(k_only, k_out)
            # context write (write_latent_kv: no query heads, no k_out): the same cache rows
            ctx = torch.full((blocks, bs, 576), 7.0).to(dtype)
            mla_kv_cache._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=ctx, slot_mapping=slots,
                                 positions=pos, cos_cache=cos, sin_cache=sin,
                                 interleaved=interleaved, q_pe=q_pe[:, :0], q_out=q_out[:, :0])
            assert torch.equal(ctx, got), "write_latent_kv cache rows"


def _per_layer_context_rows(kv, weights, eps, pos, cos, sin, interleaved, caches, slots, kv_lora):
    """The per-layer path's Triton kernels (RMSNorm launch, then rope + cache write) per layer."""
    width = kv.shape[1] // len(weights)
    for layer, (w, cache, slot) in enumerate(zip(weights, caches, slots)):
        row = kv[:, layer * width:(layer + 1) * width]
        kv_c = layernorm.rms_norm_triton(row[:, :kv_lora], w, eps)
        n = min(kv.shape[0], slot.shape[0])
        mla_kv_cache._launch(n, kv_c=kv_c[:n], k_pe=row[:n, kv_lora:], kv_cache=cache,
                             slot_mapping=slot[:n], positions=pos[:n], cos_cache=cos,
                             sin_cache=sin, interleaved=interleaved,
                             q_pe=row.new_empty(n, 0, width - kv_lora),
                             q_out=row.new_empty(n, 0, width - kv_lora))


def check_context_kv(gen):
    """write_context_kv_layers (all draft layers in one launch per 4) against the per-layer
    path's kernels (bit for bit: the same arithmetic) and the torch formula (tolerance)."""
    from vllm.v1.attention.ops import mla_context_kv
    for dtype in (torch.float32, torch.bfloat16):
        for num_layers, interleaved in ((1, True), (2, False), (5, True)):
            tokens, blocks, bs, kv_lora, rope = 6, 3, 4, 512, 64
            width = kv_lora + rope
            kv = torch.randn(tokens, num_layers * width, generator=gen).to(dtype)
            weights = [(1 + 0.1 * torch.randn(kv_lora, generator=gen)).to(dtype)
                       for _ in range(num_layers)]
            cos, sin = _tables(64, rope // 2, gen)
            pos = torch.randint(0, 64, (tokens,), generator=gen)
            pos[-1] = 10 ** 6  # a padding token: its position is clamped, its slot is -1
            # each layer its own slots: PAD (-1) rows, and a mapping shorter than the tokens
            slots = [torch.randperm(blocks * bs, generator=gen)[:tokens].clone()
                     for _ in range(num_layers)]
            for layer, s in enumerate(slots):
                s[-1] = -1
                s[layer % (tokens - 1)] = -1
            slots[-1] = slots[-1][: tokens - 2]
            got = [torch.full((blocks, bs, width), 7.0).to(dtype) for _ in range(num_layers)]
            mla_context_kv.write_context_kv_layers(kv, weights, 1e-6, pos, cos, sin, interleaved,
                                                   got, slots, kv_lora)
            same = [torch.full((blocks, bs, width), 7.0).to(dtype) for _ in range(num_layers)]
            _per_layer_context_rows(kv, weights, 1e-6, pos.clamp(max=63), cos, sin, interleaved,
                                    same, slots, kv_lora)
            for layer in range(num_layers):
                assert torch.equal(got[layer], same[layer]), ("per-layer kernels", layer, dtype)
                # the torch formula, row by row (untouched rows keep 7.0)
                ref = torch.full((blocks, bs, width), 7.0).to(dtype)
                row = kv[:, layer * width:(layer + 1) * width]
                n = min(tokens, slots[layer].shape[0])
                kv_c = layernorm.rms_norm_torch(row[:n, :kv_lora], weights[layer], 1e-6)
                p = pos[:n].clamp(max=63)
                k = rotary_embedding.rope_torch(row[:n, kv_lora:], cos[p], sin[p], interleaved)
                mla_kv_cache._concat_and_cache_torch(kv_c, k, ref, slots[layer][:n])
                torch.testing.assert_close(got[layer], ref, **TOL[dtype])


def check_context_kv_writer(gen):
    """A DFlash drafter's precompute_context_kv through ContextKVWriter (one GEMM over the
    stacked kv_a weights, one launch) against its per-layer path on the same weights; the
    stack backs every layer's weight (a later copy into a layer's weight reaches it)."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.mla_context_kv_writer import ContextKVWriter
    from vllm.model_executor.models.dflash_mla import DFlashMLAForCausalLM
    from vllm.model_executor.models.tiny import tiny_dflash_config, tiny_target_config
    from vllm.transformers_utils.config import HFConfig
    from tests.utils.context_kv_writes import (bind_caches, per_layer_context_kv,
                                               write_only_entries)
    target = tiny_target_config()
    model = DFlashMLAForCausalLM(hf_config=HFConfig(tiny_dflash_config(target, num_layers=3)))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    attns = [layer.self_attn for layer in model.model.layers]
    tokens, blocks, bs = 5, 3, 4
    aux = torch.randn(tokens, model.model.fc.weight.shape[1], generator=gen)
    pos = torch.randint(0, 100, (tokens,), generator=gen)
    slots = [torch.randperm(blocks * bs, generator=gen)[:tokens].clone() for _ in attns]
    slots[1][2] = -1
    per_layer = bind_caches(attns, blocks, bs, aux)
    per_layer_context_kv(model, attns, aux, pos, slots)
    writer = ContextKVWriter(attns, cuda_only=False)
    model.__dict__["_context_kv_writer"] = writer
    fused = bind_caches(attns, blocks, bs, aux)
    with set_forward_context(write_only_entries(attns, slots)):
        model.precompute_context_kv(aux, pos)
    assert writer.reason is None, writer.reason
    for a, b in zip(fused, per_layer):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    stack = writer._weight
    assert stack.shape[0] == 3 * 576
    for i, a in enumerate(attns):
        assert a.kv_a_proj_with_mqa.weight.data_ptr() == stack[i * 576].data_ptr()
    with torch.no_grad():  # a weight load copies into the parameter: the stack sees it
        attns[2].kv_a_proj_with_mqa.weight.mul_(2.0)
    assert torch.equal(stack[2 * 576:], attns[2].kv_a_proj_with_mqa.weight)
    # a weight replaced by another tensor: the fused path turns itself off
    attns[0].kv_a_proj_with_mqa.weight.data = attns[0].kv_a_proj_with_mqa.weight.data.clone()
    assert not writer.usable(model.context_features(aux)) and "replaced" in writer.reason


def _experts_float64(x, w13, w2, weights, ids):
    """Brute force: every (token, slot) through its expert, float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def check_moe(gen):
    for num_tokens, num_experts, top_k, block_m in ((1, 8, 3, 16), (5, 8, 2, 16), (33, 6, 4, 16), (40, 4, 2, 32)):
        hidden, inter = 48, 40  # neither a multiple of the tiles: exercises the masks
        x = torch.randn(num_tokens, hidden, generator=gen)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        weights = torch.rand(num_tokens, top_k, generator=gen)
        ref = _experts_float64(x, w13, w2, weights, ids)
        cfg = dict(BLOCK_M=block_m, GU_BLOCK_N=16, GU_BLOCK_K=32, DOWN_BLOCK_N=32, DOWN_BLOCK_K=16)
        got = moe_kernels.fused_experts_triton(x, w13, w2, weights, ids, config=cfg)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(moe_kernels.fused_experts_torch(x, w13, w2, weights, ids).double(), ref,
                                   rtol=1e-4, atol=1e-4)


CHECKS = dict(rms_norm=check_rms_norm, rope=check_rope, kv_cache=check_kv_cache, moe=check_moe,
              context_kv=check_context_kv, context_kv_writer=check_context_kv_writer)

if __name__ == "__main__":
    if not layernorm.HAS_TRITON:
        print("NO_TRITON")
        sys.exit(0)
    generator = torch.Generator().manual_seed(0)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name](generator)
    print("TRITON_INTERPRET_OK")
