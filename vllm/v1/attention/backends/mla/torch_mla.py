"""TORCH_MLA: the exact reference backend (any device, any dtype incl. float64).

It is the oracle for every other backend: it reads each decode row's visible
rank-local KV count from `row_seq_lens` (DESIGN §2 geometry computed by the
builder) and attends over exactly those tokens. Rows that see nothing return
O = 0 and LSE = -inf, which the DCP merge treats as "no contribution".
"""
from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.mla.common import (MLACommonDecodeMetadata, MLACommonImpl,
                                                    MLACommonMetadataBuilder)


class TorchMLAMetadataBuilder(MLACommonMetadataBuilder):
    supports_non_causal_multi_token_decode = True
    supports_non_causal_multi_token_dcp = True
    supports_dcp_with_varlen = True


class TorchMLAImpl(MLACommonImpl):

    def forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       decode_meta: MLACommonDecodeMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, 576] -> (out [T, H, 512] in q.dtype, lse [T, H] natural log).

        LSE is float32, or float64 when q is float64 (so float64 DCP merges stay exact).
        """
        self._check_decode_inputs(q, kv_cache, decode_meta)
        num_tokens, num_heads, _ = q.shape
        v_dim = self.kv_lora_rank
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(num_tokens, num_heads, v_dim)
        lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=compute_dtype,
                         device=q.device)
        block_size = kv_cache.shape[1]
        flat_cache = kv_cache.reshape(-1, kv_cache.shape[-1])
        bounds = decode_meta.query_start_loc_cpu.tolist()
        row_lens = decode_meta.row_seq_lens
        row_lens_cpu = row_lens.cpu()
        for req, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start:
                continue
            kv_len = int(row_lens_cpu[start:end].max())
            if kv_len == 0:
                continue
            pos = torch.arange(kv_len, device=q.device)
            # local index i lives in block_table[i // bs] at offset i % bs (DESIGN §2)
            pages = decode_meta.block_table[req, pos // block_size].to(torch.int64)
            kv = flat_cache[pages * block_size + pos % block_size].to(compute_dtype)
            scores = torch.einsum("qhd,ld->qhl", q[start:end].to(compute_dtype), kv) * self.scale
            visible = pos.unsqueeze(0) < row_lens[start:end].to(pos.device).unsqueeze(1)
            scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
            row_lse = torch.logsumexp(scores, dim=-1)
            # Empty rows have lse -inf: subtract 0 there so exp() never sees -inf - -inf.
            shift = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
            probs = torch.exp(scores - shift.unsqueeze(-1))
            out[start:end] = torch.einsum("qhl,ld->qhd", probs, kv[:, :v_dim]).to(out.dtype)
            lse[start:end] = row_lse
        if compute_dtype != torch.float64:
            lse = lse.float()
        return out, lse


class TorchMLABackend(AttentionBackend):
    lse_base_on_e = True

    @staticmethod
    def get_name() -> str:
        return "TORCH_MLA"

    @staticmethod
    def get_builder_cls() -> type:
        return TorchMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type:
        return TorchMLAImpl
