"""The attention-side Triton kernels compile for sm_90 on a machine without a GPU, in every
variant their launchers produce: the MLA cache write (plain concat, fused rope + write with and
without the rotated-k output, rotate only; interleaved and NeoX; bf16 / fp16 / fp32), the DCP
output correction (natural and base-2 LSEs) and the per-row decode lengths (causal or not, with
and without DCP). The launchers run on CPU tensors with the kernel swapped for a recorder, so the
argument types are the ones a GPU launch passes; GPU tests check the numbers."""
from __future__ import annotations

import pytest
import torch

from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

triton = pytest.importorskip("triton")

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def test_mla_cache_write_kernel_compiles_for_sm90():
    from vllm.v1.attention.ops import mla_kv_cache as mkc
    cuda_target()
    tokens, heads, blocks, block_size = 24, 16, 8, 64
    with record_launches(mkc, "_rope_concat_cache_kernel") as rec:
        for dtype in _DTYPES:
            kv_c = torch.zeros(tokens, 512, dtype=dtype)
            k_pe = torch.zeros(tokens, 64, dtype=dtype)
            cache = torch.zeros(blocks, block_size, 576, dtype=dtype)
            slots = torch.zeros(tokens, dtype=torch.int64)
            positions = torch.zeros(tokens, dtype=torch.int64)
            cos = torch.zeros(4096, 32, dtype=torch.float32)
            # concat_and_cache_mla's CUDA launch (the op itself takes torch on CPU tensors)
            mkc._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots)
            for interleaved in (False, True):
                q_pe = torch.zeros(tokens, heads, 64, dtype=dtype)
                q_out = torch.empty_like(q_pe)
                k_out = torch.empty_like(k_pe)
                common = {"positions": positions, "cos_cache": cos, "sin_cache": cos.clone(),
                          "interleaved": interleaved, "q_pe": q_pe, "q_out": q_out}
                # rope_and_write_kv (k_pe_out given) and the plain fused write
                mkc._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots,
                            k_out=k_out, **common)
                mkc._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, **common)
                # rotated_latent_kv: zero query heads, no cache, rotated k only
                empty_q = torch.zeros(tokens, 0, 64, dtype=dtype)
                mkc._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=None, slot_mapping=None,
                            positions=positions, cos_cache=cos, sin_cache=cos.clone(),
                            interleaved=interleaved, q_pe=empty_q, q_out=empty_q, k_out=k_out)
                # write_latent_kv (block drafters' context KV): zero query heads, cache, no k_out
                mkc._launch(tokens, kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots,
                            positions=positions, cos_cache=cos, sin_cache=cos.clone(),
                            interleaved=interleaved, q_pe=empty_q, q_out=empty_q)
    # per dtype: concat + 2 layouts x (write with k_out, write, rotate only, context write)
    compile_recorded(rec, expect_at_least=len(_DTYPES) * 9)


def test_dcp_output_correction_kernel_compiles_for_sm90():
    from vllm.v1.attention.ops import dcp_combine as dc
    cuda_target()
    with record_launches(dc, "_correct_attn_out_kernel") as rec:
        for dtype in _DTYPES:
            for ranks, base_e in ((2, True), (4, False)):
                out = torch.zeros(8, 32, 512, dtype=dtype)
                lses = torch.zeros(ranks, 8, 32, dtype=torch.float32)
                dc.correct_attn_out_triton(out, lses, 1, base_e)
    compile_recorded(rec, expect_at_least=len(_DTYPES) * 2)


def test_row_seq_lens_kernel_compiles_for_sm90():
    from vllm.v1.attention.backends.mla import row_seq_lens as rsl
    cuda_target()
    i32, i64 = torch.int32, torch.int64
    with record_launches(rsl, "_row_seq_lens_kernel") as rec:
        # the builder's buffers: lengths int32, request / position int64; batch tensors int32
        for causal, (cp_size, cp_rank, interleave) in ((False, (1, 0, 1)), (True, (1, 0, 1)),
                                                       (False, (2, 1, 1)), (True, (4, 3, 16))):
            decodes, tokens = 24, 96
            rsl.row_seq_lens_triton(torch.zeros(128, dtype=i32), torch.zeros(128, dtype=i64),
                                    torch.zeros(128, dtype=i64), torch.zeros(decodes + 1, dtype=i32),
                                    torch.zeros(decodes, dtype=i32), torch.zeros(decodes, dtype=i32),
                                    decodes, tokens, causal, cp_size, cp_rank, cp_interleave=interleave)
    compile_recorded(rec, expect_at_least=4)
