"""Test helpers for MLA prefill attention: random cases with cached context, paged (and DCP
sharded) latent caches written like the runner does, a float64 dense oracle, and a minimal layer
object carrying what `forward_mla_prefill` reads from MLAAttention."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tests.utils.mla_dcp_helpers import mla_spec, parallel_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
from vllm.v1.attention.ops.mla_kv_cache import concat_and_cache_mla
from vllm.v1.worker.gpu.cp_utils import cp_local_slot

# DeepSeek-V3 MLA dims
R, ROPE, NOPE, V = 512, 64, 128, 128


@dataclass
class PrefillCase:
    context_lens: list[int]       # cached tokens before this step's chunk, per request
    query_lens: list[int]         # new tokens this step, per request
    c_kv: list[torch.Tensor]      # per request [c + m, R] latent of every token
    k_pe: list[torch.Tensor]      # per request [c + m, ROPE] (already rotated)
    q: torch.Tensor               # [sum m, H, NOPE + ROPE]
    w_kv_b: torch.Tensor          # [H, NOPE + V, R]
    scale: float

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    def new_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [T, R], k_pe [T, ROPE]) of the new tokens, batch order."""
        return (torch.cat([c[ctx:] for c, ctx in zip(self.c_kv, self.context_lens)]),
                torch.cat([k[ctx:] for k, ctx in zip(self.k_pe, self.context_lens)]))


def make_prefill_case(context_lens, query_lens, num_heads=4, seed=0,
                      dtype=torch.float64) -> PrefillCase:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype)

    c_kv = [rand(c + m, R, s=0.5) for c, m in zip(context_lens, query_lens)]
    k_pe = [rand(c + m, ROPE) for c, m in zip(context_lens, query_lens)]
    q = rand(sum(query_lens), num_heads, NOPE + ROPE)
    w = rand(num_heads, NOPE + V, R, s=1.0 / math.sqrt(R))
    return PrefillCase(list(context_lens), list(query_lens), c_kv, k_pe, q, w,
                       1.0 / math.sqrt(NOPE + ROPE))


def reference_prefill(case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 causal attention of every new token over its whole prefix (context + the
    new tokens up to itself), expanded form. -> (O [T, H, V], LSE [T, H])."""
    outs, lses = [], []
    w = case.w_kv_b.double()
    t = 0
    for c_kv, k_pe, ctx, m in zip(case.c_kv, case.k_pe, case.context_lens, case.query_lens):
        kv = torch.einsum("nr,hdr->nhd", c_kv.double(), w)
        k = torch.cat([kv[..., :NOPE], k_pe.double()[:, None].expand(-1, w.shape[0], -1)], -1)
        v = kv[..., NOPE:]
        q = case.q[t:t + m].double()
        s = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        visible = torch.arange(ctx + m)[None, :] <= (ctx + torch.arange(m))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
        t += m
    return torch.cat(outs), torch.cat(lses)


def fake_layer(w_kv_b: torch.Tensor, scale: float, kv_cache: torch.Tensor) -> SimpleNamespace:
    """What forward_mla_prefill reads from MLAAttention (weights of this rank's heads)."""
    heads = w_kv_b.shape[0]
    weight = w_kv_b.reshape(heads * (NOPE + V), R).contiguous()
    return SimpleNamespace(
        kv_b_proj=SimpleNamespace(weight=weight),
        _kv_b_weight=lambda: weight.view(heads, NOPE + V, R),
        qk_nope_head_dim=NOPE, v_head_dim=V, kv_lora_rank=R, qk_rope_head_dim=ROPE,
        scaling=scale, kv_cache=kv_cache, num_local_heads=heads)


def build_prefill_rank(case: PrefillCase, n: int = 1, rank: int = 0, interleave: int = 1,
                       block_size: int = 4, chunk: int = 8, device="cpu", cache_dtype=None,
                       host_twins: bool = True, fill=float("nan"), builder_cls=None):
    """Write every token of the case (context and new tokens, as write_kv does before attention)
    into `rank`'s shard of a paged cache with shuffled block ids, and build the prefill metadata.
    Returns (metadata.prefill, kv_cache). Unwritten slots hold `fill` (NaN: a wrong read shows)."""
    dtype = cache_dtype or case.q.dtype
    virtual = block_size * n
    lens = [c + m for c, m in zip(case.context_lens, case.query_lens)]
    blocks = [-(-L // virtual) for L in lens]
    total = sum(blocks)
    ids = torch.randperm(total + 3, generator=torch.Generator().manual_seed(11))[:total] + 1
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    cache = torch.full((total + 4, block_size, R + ROPE), fill, dtype=dtype)
    off = 0
    for b, L in enumerate(lens):
        table[b, :blocks[b]] = ids[off:off + blocks[b]].to(torch.int32)
        off += blocks[b]
        slots = cp_local_slot(torch.arange(L), table[b], block_size, n, rank, interleave)
        concat_and_cache_mla(case.c_kv[b].to(dtype), case.k_pe[b].to(dtype), cache, slots)
    qsl = torch.tensor([0] + torch.tensor(case.query_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        num_reqs=len(lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(case.query_lens),
        max_seq_len=max(lens), block_table_tensor=table.to(device),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens if host_twins else None,
        num_computed_tokens_cpu=(torch.tensor(case.context_lens, dtype=torch.int32)
                                 if host_twins else None))
    builder = (builder_cls or TorchMLAMetadataBuilder)(
        mla_spec(block_size, False, dtype), ["layer.0"], parallel_config(n, interleave), device,
        dcp_rank=rank)
    builder.prefill_context_chunk_tokens = chunk
    builder.reorder_batch_threshold = 0  # every row, 1-token ones too, takes the prefill path
    md = builder.build(0, cm)
    assert md.num_decodes == 0 and md.prefill is not None
    return md.prefill, cache.to(device)
