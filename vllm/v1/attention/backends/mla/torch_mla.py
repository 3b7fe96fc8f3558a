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
        Fixed shapes from the metadata's host bounds only (rows B, block length Q = max_query_len,
        L = max_seq_len local tokens): no host sync, and the same shapes replay in a CUDA graph.
        Each request's first L local tokens are gathered once through its block table; every row
        masks them down to its own visible count (row_seq_lens).
        """
        self._check_decode_inputs(q, kv_cache, decode_meta)
        num_tokens, num_heads, _ = q.shape
        v_dim = self.kv_lora_rank
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        num_reqs = decode_meta.block_table.shape[0]
        q_len = max(int(decode_meta.max_query_len), 1)
        kv_len = max(int(decode_meta.max_seq_len), 1)
        block_size = kv_cache.shape[1]
        table = decode_meta.block_table
        max_pages = table.shape[1]
        pos = torch.arange(kv_len, device=q.device)
        page_idx = (pos // block_size).clamp(max=max_pages - 1)
        pages = table[:, page_idx].to(torch.int64)                       # [B, L]
        flat_cache = kv_cache.reshape(-1, kv_cache.shape[-1])
        kv = flat_cache[pages * block_size + pos % block_size].to(compute_dtype)  # [B, L, 576]
        req = decode_meta.row_req[:num_tokens]
        j = decode_meta.row_pos[:num_tokens].clamp(max=q_len - 1)
        row_lens = torch.zeros(num_reqs, q_len, dtype=torch.int64, device=q.device)
        row_lens[req, j] = decode_meta.row_seq_lens[:num_tokens].to(torch.int64)
        # Slots past what any row of the request sees may hold garbage (NaN in tests, stale KV
        # in the engine): zero them, so 0-probability positions contribute exactly 0.
        seen = pos.view(1, -1) < row_lens.max(dim=1).values.unsqueeze(1)  # [B, L]
        kv = torch.where(seen.unsqueeze(-1), kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
        q_pad = torch.zeros(num_reqs, q_len, num_heads, q.shape[-1], dtype=compute_dtype,
                            device=q.device)
        q_pad[req, j] = q.to(compute_dtype)
        scores = torch.einsum("bqhd,bld->bqhl", q_pad, kv) * self.scale   # [B, Q, H, L]
        visible = pos.view(1, 1, -1) < row_lens.unsqueeze(-1)            # [B, Q, L]
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)                        # [B, Q, H]
        # Empty rows have lse -inf: subtract 0 there so exp() never sees -inf - -inf.
        shift = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        probs = torch.exp(scores - shift.unsqueeze(-1))
        out_pad = torch.einsum("bqhl,bld->bqhd", probs, kv[..., :v_dim])
        out = out_pad[req, j].to(q.dtype)
        lse = row_lse[req, j]
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
