"""Test helpers: random MLA decode cases, sharded paged caches, brute-force oracles."""
from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from vllm.config import ParallelConfig, VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.ops.mla_kv_cache import concat_and_cache_mla
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.worker.gpu.cp_utils import cp_local_slot

WIDTH, V_DIM = 576, 512


def brute_local_count(seq_len: int, n: int, rank: int, interleave: int) -> int:
    """How many of the first `seq_len` global tokens rank `rank` stores (by enumeration)."""
    return sum(1 for t in range(seq_len) if (t // interleave) % n == rank)


def parallel_config(dcp: int = 1, interleave: int = 1) -> VllmConfig:
    """A VllmConfig whose TP ranks are all DCP ranks."""
    return VllmConfig(parallel_config=ParallelConfig(
        tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave))


def mla_spec(block_size: int, non_causal: bool = False, dtype=torch.float64) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=block_size, dtype=dtype,
                            non_causal_multi_token_decode=non_causal)


@dataclass
class DecodeCase:
    kv: list[torch.Tensor]   # per request: global latent [G_b, 576]
    q: torch.Tensor          # [T, H, 576]
    seq_lens: list[int]      # global G_b (0 for padding rows)
    query_lens: list[int]    # 0 for padding rows
    causal: bool
    scale: float

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


def make_case(seq_lens, query_lens, num_heads=4, causal=True, seed=0,
              dtype=torch.float64) -> DecodeCase:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn(g, WIDTH, generator=gen, dtype=torch.float64).to(dtype) for g in seq_lens]
    q = torch.randn(sum(query_lens), num_heads, WIDTH, generator=gen,
                    dtype=torch.float64).to(dtype)
    return DecodeCase(kv, q, list(seq_lens), list(query_lens), causal, 1.0 / math.sqrt(WIDTH))


def reference_decode(case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention per row straight from the global KV (no paging, no DCP)."""
    out = torch.zeros(case.q.shape[0], case.q.shape[1], V_DIM, dtype=torch.float64)
    lse = torch.full(case.q.shape[:2], float("-inf"), dtype=torch.float64)
    t = 0
    for kv, g, qlen in zip(case.kv, case.seq_lens, case.query_lens):
        kv = kv.double()
        for j in range(qlen):
            visible = g - (qlen - 1 - j) if case.causal else g
            if visible > 0:
                s = case.q[t].double() @ kv[:visible].T * case.scale  # [H, visible]
                lse[t] = torch.logsumexp(s, -1)
                out[t] = torch.softmax(s, -1) @ kv[:visible, :V_DIM]
            t += 1
    return out, lse


def build_rank(case: DecodeCase, builder_cls, n: int, rank: int, interleave: int,
               block_size: int, non_causal_group: bool | None = None, fill=float("nan"),
               pass_local_lens: bool = True, builder_kwargs=None, device="cpu"):
    """Shard the case's KV onto `rank` (written through cp_local_slot + concat_and_cache_mla)
    and build its metadata. Returns (metadata, kv_cache, common_attn_metadata, builder)."""
    dtype = case.q.dtype
    virtual = block_size * n
    blocks_per_req = [max(1, -(-g // virtual)) for g in case.seq_lens]
    max_blocks = max(blocks_per_req)
    # distinct, shuffled block ids so a wrong table lookup reads the wrong (or NaN) page
    total = sum(blocks_per_req)
    ids = torch.randperm(total + 3, generator=torch.Generator().manual_seed(7))[:total] + 1
    table = torch.zeros(case.num_reqs, max_blocks, dtype=torch.int32)
    cache = torch.full((total + 4, block_size, WIDTH), fill, dtype=dtype)
    off = 0
    for b, (kv, g) in enumerate(zip(case.kv, case.seq_lens)):
        table[b, :blocks_per_req[b]] = ids[off: off + blocks_per_req[b]].to(torch.int32)
        off += blocks_per_req[b]
        if g:
            slots = cp_local_slot(torch.arange(g), table[b], block_size, n, rank, interleave)
            concat_and_cache_mla(kv[:, :V_DIM], kv[:, V_DIM:], cache, slots)
    qsl = torch.tensor([0] + list(torch.tensor(case.query_lens).cumsum(0).tolist()),
                       dtype=torch.int32)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    local = None
    if n > 1 and pass_local_lens:
        local = torch.tensor([brute_local_count(g, n, rank, interleave) for g in case.seq_lens],
                             dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        num_reqs=case.num_reqs, num_actual_tokens=int(qsl[-1]),
        max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
        block_table_tensor=table.to(device),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=device),
        causal=case.causal, dcp_local_seq_lens=None if local is None else local.to(device),
        seq_lens_cpu=seq_lens, dcp_local_seq_lens_cpu=local, block_table_cpu=table)
    flag = (not case.causal) if non_causal_group is None else non_causal_group
    builder = builder_cls(mla_spec(block_size, flag, dtype), ["layer.0"],
                          parallel_config(n, interleave), device, dcp_rank=rank,
                          **(builder_kwargs or {}))
    # Every case here is a decode batch: its longest query row must take the decode path
    # (the runner sets the threshold to 1 + num_speculative_tokens the same way).
    builder.reorder_batch_threshold = max(max(case.query_lens), 1)
    return builder.build(0, cm), cache.to(device), cm, builder
