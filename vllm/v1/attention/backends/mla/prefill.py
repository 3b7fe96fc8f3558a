"""MLA prefill attention without an L x L matrix (DESIGN §9).

A prefill row (query longer than the builder's `reorder_batch_threshold`) holds `m` new tokens at
global positions [c, c + m), where c >= 0 tokens of context are already in the paged latent cache
(an earlier chunk of a chunked prefill). Its attention splits into two parts over disjoint keys,
each returning (O, LSE), merged by LSE:

  * self:    the new tokens attend causally to themselves (expanded form: K_nope / V from
             kv_b_proj of the in-hand c_kv, qk head dim nope + rope, v head dim v);
  * context: the new tokens attend, without a mask (every context position precedes every new
             token), to the cached context, read from the paged latent cache in passes of at most
             `context_chunk_tokens` tokens (c_kv and k_pe gathered, kv_b_proj -> K_nope and V).

Nothing larger than (query tokens x chunk) scores per head is ever formed: the self part is
tiled by key chunks of the same size (the torch path tiles queries too, see TORCH_TILE_TOKENS). The torch path (any device, float64 capable) is the
reference; on CUDA with FlashInfer the same decomposition runs through
`BatchPrefillWithRaggedKVCacheWrapper` (causal for self, non-causal for context chunks).

DCP: every rank stores only its shard of the context. Heads: under TP = DCP a rank owns only its
heads' q and kv_b_proj rows, but an LSE merge across ranks needs every rank to compute the SAME
heads over different shards. We all-gather q over the DCP group (exactly as decode does) and give
each rank the kv_b_proj rows of the whole group's heads (all-gathered once per layer, cached):
the expanded form costs (nope + rope + v) = 320 multiply-adds per query-key pair per head against
576 + 512 = 1088 for the absorbed form, and a prefill has thousands of queries per context token,
so expanding the context once per pass is the cheaper choice (it is also vLLM's prefill choice).
Each rank attends its own context shard (rank-local positions from the same geometry as decode);
partials merge with `cp_lse_ag_out_rs` (LSEs all-gathered, O reduce-scattered back to own heads);
no KV is all-gathered. The self part needs no communication: every rank has the new tokens' KV.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.ops.dcp_combine import merge_attn_states

logger = logging.getLogger(__name__)
LN2 = math.log(2.0)
# (qk, vo) head dims and dtypes the FlashInfer ragged prefill serves here: DeepSeek's 192/128 with
# the fa3 kernels (sm90). Other shapes (the tiny test model's 96/32) or float32 use the torch path.
FLASHINFER_PREFILL_HEAD_DIMS = {(192, 128)}
FLASHINFER_PREFILL_DTYPES = (torch.bfloat16, torch.float16)
# Context tokens gathered (summed over the prefill rows) per pass. Bounds the workspace of the
# gathered c_kv / expanded K, V and every score tile; the runner may set it on the builder.
DEFAULT_CONTEXT_CHUNK_TOKENS = 8192
FLASHINFER_PREFILL_WORKSPACE_BYTES = 128 * 1024 * 1024
# The torch path also tiles queries and keys by this many tokens, so its score tensors stay
# at tile x tile per head even with a large context pass (it runs the CPU 32k-token prompt).
TORCH_TILE_TOKENS = 1024


@dataclass
class MLAContextChunk:
    """One pass over the cached context of every prefill row (rank-local token indices).

    Row i reads its local context tokens [starts_cpu[i], starts_cpu[i] + lens_cpu[i]); the
    gathered tokens are laid out row after row (`cu_lens_cpu` is the ragged kv indptr).
    """

    starts_cpu: torch.Tensor   # [P] int64
    lens_cpu: torch.Tensor     # [P] int64
    cu_lens_cpu: torch.Tensor  # [P + 1] int32
    num_tokens: int
    slots: torch.Tensor        # [num_tokens] int64 device: rows of the flattened latent cache
    # [T_prefill] bool device, True where the query token's row reads >= 1 token in this pass;
    # None when every row does. Kernels given kv_len = 0 rows are not trusted to return
    # O = 0 / LSE = -inf, so those rows are pinned explicitly.
    token_has_kv: torch.Tensor | None = None


@dataclass
class MLACommonPrefillMetadata:
    """Prefill rows of one step (they follow the decode rows). Tensors cover the P prefill rows.

    `context_lens_cpu` are GLOBAL context lengths (tokens before this step's chunk);
    `local_context_lens_cpu` what this DCP rank stores of them (equal without DCP).
    `has_context` is decided on global lengths, so every DCP rank takes the same branch (the
    context part runs collectives).
    """

    query_start_loc: torch.Tensor        # [P+1] int32 device, relative to the first prefill token
    seq_lens: torch.Tensor               # [P] global lengths incl. the new tokens (device)
    max_query_len: int
    query_start_loc_cpu: torch.Tensor | None = None  # host twin of query_start_loc
    seq_lens_cpu: torch.Tensor | None = None          # [P] int64 host
    context_lens_cpu: torch.Tensor | None = None      # [P] int64 host, global
    local_context_lens_cpu: torch.Tensor | None = None  # [P] int64 host, this rank
    block_table: torch.Tensor | None = None           # [P, max_blocks] int32 device
    context_chunks: list[MLAContextChunk] = field(default_factory=list)
    context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS
    has_context: bool = False
    dcp_world_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    backend: str = "torch"               # "torch" or "flashinfer"
    backend_state: Any = None            # FlashInfer plans of this step (shared by all layers)


# --------------------------------------------------------------------------------- metadata
def _host_seq_lens(cm: CommonAttentionMetadata, rows: slice) -> torch.Tensor:
    if cm.seq_lens_cpu is not None:
        return cm.seq_lens_cpu[rows].to(torch.int64)
    if cm.seq_lens.device.type == "cpu":
        return cm.seq_lens[rows].to(torch.int64)  # already on the host: no sync
    raise ValueError(
        "MLA prefill metadata needs the exact host lengths: fill "
        "CommonAttentionMetadata.seq_lens_cpu (the runner's host twin of seq_lens); the device "
        f"seq_lens live on {cm.seq_lens.device} and reading them would sync with the host.")


def build_prefill_metadata(cm: CommonAttentionMetadata, num_decodes: int, num_prefills: int,
                           num_decode_tokens: int, qsl_cpu: torch.Tensor, *,
                           dcp_world_size: int = 1, dcp_rank: int = 0, dcp_interleave: int = 1,
                           block_size: int | None = None,
                           context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
                           backend: str = "torch", backend_state: Any = None
                           ) -> MLACommonPrefillMetadata:
    """Prefill metadata of rows [num_decodes, num_decodes + num_prefills), from host twins only
    (the context pass plan is host arithmetic; its gather indices are built on the device from
    host integers and the device block table, without reading device data back)."""
    if context_chunk_tokens < 1:
        raise ValueError(f"context_chunk_tokens={context_chunk_tokens} must be >= 1")
    rows = slice(num_decodes, num_decodes + num_prefills)
    rel = (qsl_cpu[num_decodes: num_decodes + num_prefills + 1] - num_decode_tokens).to(torch.int64)
    query_lens = rel[1:] - rel[:-1]
    seq_lens_cpu = _host_seq_lens(cm, rows)
    if cm.num_computed_tokens_cpu is not None:
        context = cm.num_computed_tokens_cpu[rows].to(torch.int64)
    else:
        context = seq_lens_cpu - query_lens
    if bool((context < 0).any()):
        raise ValueError(f"MLA prefill metadata: seq_lens {seq_lens_cpu.tolist()} are shorter than "
                         f"the query lengths {query_lens.tolist()}; seq_lens must include the "
                         "new tokens")
    if dcp_world_size > 1:
        from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens  # decode's geometry
        local = get_dcp_local_seq_lens(context, dcp_world_size, dcp_rank,
                                       dcp_interleave).to(torch.int64)
    else:
        local = context
    has_context = bool((context > 0).any())
    block_table = cm.block_table_tensor[rows]
    device = cm.query_start_loc.device
    chunks: list[MLAContextChunk] = []
    if has_context:
        if block_size is None:
            raise ValueError("MLA prefill metadata with cached context needs the KV block size")
        chunks = _plan_context_chunks(local, context_chunk_tokens, block_table, block_size,
                                      device, query_lens)
    return MLACommonPrefillMetadata(
        query_start_loc=rel.to(device=device, dtype=torch.int32),
        seq_lens=cm.seq_lens[rows],
        max_query_len=int(query_lens.max()) if num_prefills else 0,
        query_start_loc_cpu=rel.to(torch.int32),
        seq_lens_cpu=seq_lens_cpu, context_lens_cpu=context, local_context_lens_cpu=local,
        block_table=block_table, context_chunks=chunks,
        context_chunk_tokens=context_chunk_tokens, has_context=has_context,
        dcp_world_size=dcp_world_size, dcp_rank=dcp_rank, dcp_interleave=dcp_interleave,
        backend=backend, backend_state=backend_state)


def _plan_context_chunks(local: torch.Tensor, chunk: int, block_table: torch.Tensor,
                         block_size: int, device: torch.device,
                         query_lens: torch.Tensor) -> list[MLAContextChunk]:
    """Cut the rows' local contexts, laid end to end, into passes of at most `chunk` tokens.

    Under DCP some rank may store nothing (e.g. a 1-token context on rank 1): it still plans one
    empty pass when the context exists globally, so that every rank joins the same collectives.
    """
    num_rows = local.shape[0]
    row_start = torch.cumsum(local, 0) - local          # stream offset of each row's context
    row_end = row_start + local
    total = int(local.sum())
    num_passes = max(1, -(-total // chunk))
    rows = torch.arange(num_rows, device=device)
    chunks = []
    for j in range(num_passes):
        lo, hi = j * chunk, min((j + 1) * chunk, total)
        seg_lo = torch.clamp(row_start, min=lo)
        seg_hi = torch.clamp(row_end, max=hi)
        lens = torch.clamp(seg_hi - seg_lo, min=0)
        starts = torch.where(lens > 0, seg_lo - row_start, torch.zeros_like(lens))
        cu = torch.zeros(num_rows + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
        n = int(cu[-1])
        if n:
            lens_dev = lens.to(device)
            row_of = torch.repeat_interleave(rows, lens_dev, output_size=n)
            first = (torch.cumsum(lens_dev, 0) - lens_dev)[row_of]
            local_pos = torch.arange(n, device=device) - first + starts.to(device)[row_of]
            # Local index i of a row lives in block_table[i // block_size] at offset
            # i % block_size (DESIGN §2: every rank uses the same block ids).
            pages = block_table[row_of, local_pos // block_size].to(torch.int64)
            slots = pages * block_size + local_pos % block_size
        else:
            slots = torch.zeros(0, dtype=torch.int64, device=device)
        token_has_kv = None
        if n and bool((lens == 0).any()):
            token_has_kv = torch.repeat_interleave(lens > 0, query_lens).to(device)
        chunks.append(MLAContextChunk(starts, lens, cu, n, slots, token_has_kv))
    return chunks


# --------------------------------------------------------------------------- torch kernels
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] -> (O [Tq, H, Dv], LSE [Tq, H] natural log).

    The only score tensor is [H, Tq, Tk] (callers keep Tk <= the chunk size), updated in place
    (max, subtract, exp, sum: the elementwise passes dominate on CPU). Rows that see no key give
    O = 0, LSE = -inf (the merge then ignores them)."""
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0))   # [H, Tq, Tk]
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    empty = total == 0
    out = torch.matmul(probs, v.transpose(0, 1))                   # [H, Tq, Dv]
    out = out / torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), peak + torch.log(total))
    return out.transpose(0, 1), lse.squeeze(-1).transpose(0, 1)


def _merge(state, out, lse):
    if state is None:
        return out, lse
    merged, merged_lse = merge_attn_states(torch.stack([state[0], out]),
                                           torch.stack([state[1], lse]))
    return merged, merged_lse


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attend_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_attend over query and key tiles of at most `tile` tokens, merged by LSE (scores per head
    never exceed tile x tile). causal: q and k are the same tokens; query i sees keys <= i, and
    key tiles past a query tile's last row are skipped."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[0], q.shape[1])
    for qa in range(0, q.shape[0], tile):
        qb = min(qa + tile, q.shape[0])
        key_end = qb if causal else k.shape[0]
        state = None
        for ka in range(0, key_end, tile):
            kb = min(ka + tile, key_end)
            mask = None
            if causal and kb > qa + 1:  # the tile reaches past some query row's diagonal
                mask = (torch.arange(ka, kb, device=q.device)[None, :]
                        <= torch.arange(qa, qb, device=q.device)[:, None]).unsqueeze(0)
            state = _merge(state, *_attend(q[qa:qb], k[ka:kb], v[ka:kb], scale, mask))
        out[qa:qb], lse[qa:qb] = state
    return out, lse


def _torch_tile(meta: MLACommonPrefillMetadata) -> int:
    return max(1, min(meta.context_chunk_tokens, TORCH_TILE_TOKENS))


def self_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         meta: MLACommonPrefillMetadata, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each prefill row's new tokens over themselves, in tiles of at most
    min(context_chunk_tokens, TORCH_TILE_TOKENS) tokens.
    q, k [T, H, Dqk], v [T, H, Dv] -> (O [T, H, Dv], LSE [T, H])."""
    compute = _compute_dtype(q.dtype)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=compute)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=compute, device=q.device)
    bounds = meta.query_start_loc_cpu.tolist()
    tile = _torch_tile(meta)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        out[start:end], lse[start:end] = _attend_tiled(
            q[start:end].to(compute), k[start:end].to(compute), v[start:end].to(compute),
            scale, causal=True, tile=tile)
    return out, lse


def expand_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor,
                  qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """c_kv [n, R], rotated k_pe [n, rope], kv_b_proj rows w_kv_b [H, nope + v, R]
    -> k [n, H, nope + rope], v [n, H, v] (the expanded form of cached tokens)."""
    kv = torch.einsum("nr,hdr->nhd", c_kv, w_kv_b)
    k_nope, v = kv.split([qk_nope_head_dim, kv.shape[-1] - qk_nope_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, w_kv_b.shape[0], -1)], dim=-1)
    return k, v


def context_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                            meta: MLACommonPrefillMetadata, scale: float, kv_lora_rank: int,
                            qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the prefill tokens q [T, H, Dqk] over THIS rank's cached context, pass by
    pass (non-causal), merged by LSE. kv_cache [blocks, block_size, R + rope] latent cache;
    w_kv_b [H, nope + v, R] the kv_b_proj rows of q's heads. -> (O [T, H, v], LSE [T, H])."""
    compute = _compute_dtype(q.dtype)
    num_heads = q.shape[1]
    v_dim = w_kv_b.shape[1] - qk_nope_head_dim
    out = q.new_zeros(q.shape[0], num_heads, v_dim, dtype=compute)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=compute, device=q.device)
    bounds = meta.query_start_loc_cpu.tolist()
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    w = w_kv_b.to(compute)
    for chunk in meta.context_chunks:
        if chunk.num_tokens == 0:
            continue
        latent = flat[chunk.slots].to(compute)                  # [n, R + rope]
        k, v = expand_latent(latent[:, :kv_lora_rank], latent[:, kv_lora_rank:], w,
                             qk_nope_head_dim)
        cu = chunk.cu_lens_cpu.tolist()
        for row, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start or cu[row + 1] == cu[row]:
                continue
            o_c, lse_c = _attend_tiled(q[start:end].to(compute), k[cu[row]:cu[row + 1]],
                                       v[cu[row]:cu[row + 1]], scale, causal=False,
                                       tile=_torch_tile(meta))
            out[start:end], lse[start:end] = _merge((out[start:end], lse[start:end]), o_c, lse_c)
    return out, lse


# ------------------------------------------------------------------------------ FlashInfer
class FlashInferPrefillState:
    """Per-builder FlashInfer ragged-prefill wrappers (one float workspace, wrappers reused
    across steps) and the plans of the current step, made on first use by the first layer and
    shared by every layer of the group (all layers have the same head count and dtype)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._workspace: torch.Tensor | None = None
        self._pool: list[Any] = []
        self._plans: dict[tuple, Any] = {}
        self._meta: MLACommonPrefillMetadata | None = None

    def begin_step(self, meta: MLACommonPrefillMetadata) -> None:
        self._plans = {}
        self._meta = meta

    def _wrapper(self) -> Any:
        import flashinfer.prefill
        if self._workspace is None:
            self._workspace = torch.zeros(FLASHINFER_PREFILL_WORKSPACE_BYTES, dtype=torch.uint8,
                                          device=self.device)
        index = len(self._plans)
        while len(self._pool) <= index:
            # fa3 is the Hopper kernel family our GPUs run; "auto" may pick kernels that reject
            # head dims 192/128 on sm90 (DESIGN §5: pass the backend explicitly).
            major = torch.cuda.get_device_capability(self.device)[0]
            self._pool.append(flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, kv_layout="NHD", backend="fa3" if major == 9 else "auto"))
        return self._pool[index]

    def planned(self, kind: str, index: int, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                num_heads: int, head_dim_qk: int, head_dim_vo: int, causal: bool, scale: float,
                dtype: torch.dtype) -> Any:
        key = (kind, index, num_heads, head_dim_qk, head_dim_vo, dtype, float(scale))
        wrapper = self._plans.get(key)
        if wrapper is None:
            wrapper = self._wrapper()
            # Host indptrs: plan() reads them on the host anyway, so no device sync is added.
            wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=num_heads,
                         num_kv_heads=num_heads, head_dim_qk=head_dim_qk,
                         head_dim_vo=head_dim_vo, causal=causal, sm_scale=float(scale),
                         q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
            self._plans[key] = wrapper
        return wrapper


def _run_flashinfer(wrapper: Any, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = wrapper.run(q.contiguous(), k.contiguous(), v.contiguous(), return_lse=True)
    # FlashInfer's ragged prefill returns a base-2 LSE by default; the merges here are in
    # natural log, so convert at this boundary (a wrong base silently mis-weights the parts).
    return out, lse.float() * LN2


def self_attention_flashinfer(q, k, v, meta: MLACommonPrefillMetadata, scale: float):
    state: FlashInferPrefillState = meta.backend_state
    qsl = meta.query_start_loc_cpu
    wrapper = state.planned("self", 0, qsl, qsl, q.shape[1], q.shape[2], v.shape[2], True,
                            scale, q.dtype)
    return _run_flashinfer(wrapper, q, k, v)


def context_attention_flashinfer(q, kv_cache, w_kv_b, meta: MLACommonPrefillMetadata,
                                 scale: float, kv_lora_rank: int, qk_nope_head_dim: int):
    state: FlashInferPrefillState = meta.backend_state
    v_dim = w_kv_b.shape[1] - qk_nope_head_dim
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    w = w_kv_b.to(q.dtype)
    merged = None
    for j, chunk in enumerate(meta.context_chunks):
        if chunk.num_tokens == 0:
            continue
        latent = flat[chunk.slots].to(q.dtype)
        k, v = expand_latent(latent[:, :kv_lora_rank], latent[:, kv_lora_rank:], w,
                             qk_nope_head_dim)
        wrapper = state.planned("context", j, meta.query_start_loc_cpu, chunk.cu_lens_cpu,
                                q.shape[1], q.shape[2], v_dim, False, scale, q.dtype)
        out_c, lse_c = _run_flashinfer(wrapper, q, k, v)
        if chunk.token_has_kv is not None:
            keep = chunk.token_has_kv[:, None]
            lse_c = torch.where(keep, lse_c, torch.full_like(lse_c, float("-inf")))
            out_c = torch.where(keep[..., None], out_c, torch.zeros_like(out_c))
        merged = _merge(merged, out_c, lse_c)
    if merged is None:
        return (q.new_zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float32),
                torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
    return merged


# --------------------------------------------------------------------------- the layer path
_warned_fallback: set = set()


def _flashinfer_serves(head_dim_qk: int, head_dim_vo: int, dtype: torch.dtype) -> bool:
    if (head_dim_qk, head_dim_vo) in FLASHINFER_PREFILL_HEAD_DIMS and \
            dtype in FLASHINFER_PREFILL_DTYPES:
        return True
    key = (head_dim_qk, head_dim_vo, dtype)
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        logger.warning("FLASHINFER_MLA prefill serves head dims %s in %s; head dims (%d, %d) in "
                       "%s use the torch prefill path", sorted(FLASHINFER_PREFILL_HEAD_DIMS),
                       [str(d) for d in FLASHINFER_PREFILL_DTYPES], head_dim_qk, head_dim_vo,
                       dtype)
    return False


def _group_kv_b_weight(layer: Any, dcp: Any) -> torch.Tensor:
    """kv_b_proj rows [N * H_local, nope + v, R] of every head of the DCP group, all-gathered
    once per layer (and again only if the weight tensor is replaced or modified)."""
    weight = layer.kv_b_proj.weight
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor has no version counter (it cannot change)
        version = 0
    key = (weight.data_ptr(), version, dcp.world_size)
    cached = getattr(layer, "_prefill_group_kv_b", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    gathered = dcp.all_gather(weight.detach().contiguous(), dim=0)
    per_head = layer.qk_nope_head_dim + layer.v_head_dim
    full = gathered.view(-1, per_head, layer.kv_lora_rank)
    layer._prefill_group_kv_b = (key, full)
    return full


def forward_mla_prefill(layer: Any, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        kv_c: torch.Tensor, k_pe: torch.Tensor,
                        meta: MLACommonPrefillMetadata) -> torch.Tensor:
    """The prefill rows of an MLA layer: -> [T_prefill, H_local, v_head_dim] in q's dtype.

    `layer` is the MLAAttention module (kv_b_proj, head dims, scaling, kv_cache); q_nope / q_pe
    (rotated) [T, H_local, *] and kv_c (normed) / k_pe (rotated) [T, *] are the prefill tokens'
    projections. Their KV is already in the cache; the self part uses the in-hand copies.
    """
    from vllm.model_executor.layers.parallel_utils import dcp_group
    num_tokens = q_nope.shape[0]
    if int(meta.query_start_loc_cpu[-1]) != num_tokens:
        raise ValueError(f"forward_mla_prefill: metadata covers {int(meta.query_start_loc_cpu[-1])}"
                         f" tokens, got {num_tokens}; pass only the prefill tokens")
    nope, rank = layer.qk_nope_head_dim, layer.kv_lora_rank
    w_local = layer._kv_b_weight()                              # [H_local, nope + v, R]
    q = torch.cat([q_nope, q_pe], dim=-1)                       # [T, H_local, nope + rope]
    k, v = expand_latent(kv_c, k_pe, w_local.to(kv_c.dtype), nope)
    use_fi = meta.backend == "flashinfer" and _flashinfer_serves(q.shape[-1], layer.v_head_dim,
                                                                 q.dtype)
    self_fn = self_attention_flashinfer if use_fi else self_attention_torch
    ctx_fn = context_attention_flashinfer if use_fi else context_attention_torch
    out, lse = self_fn(q, k, v, meta, layer.scaling)
    if meta.has_context:
        # The layer's own split (a replicated draft layer reads its full local cache); stand-in
        # layers without one follow the engine's DCP group.
        own_group = getattr(layer, "attn_dcp_group", None)
        dcp = own_group() if own_group is not None else dcp_group()
        if dcp.world_size > 1:
            from vllm.v1.attention.ops.dcp_combine import cp_lse_ag_out_rs, dcp_all_gather_q
            q_group = dcp_all_gather_q(q.contiguous(), dcp)      # [T, N * H_local, Dqk]
            o_ctx, lse_ctx = ctx_fn(q_group, layer.kv_cache, _group_kv_b_weight(layer, dcp),
                                    meta, layer.scaling, rank, nope)
            o_ctx, lse_ctx = cp_lse_ag_out_rs(o_ctx.contiguous(), lse_ctx.contiguous(), dcp,
                                              lse_base_on_e=True, return_lse=True)
        else:
            o_ctx, lse_ctx = ctx_fn(q, layer.kv_cache, w_local, meta, layer.scaling, rank, nope)
        out, lse = merge_attn_states(torch.stack([out, o_ctx.to(out.dtype)]),
                                     torch.stack([lse.to(lse_ctx.dtype), lse_ctx]))
    return out.to(q_nope.dtype)
