"""MLA attention metadata, its builder (DESIGN §3; prefill metadata in prefill.py) and the
DSpark+DCP start-up capability check.

Decode kinds (all take the decode path, decode rows come first in the batch):
  * causal single token   (Q == 1): the row sees local(G) tokens of its rank;
  * causal multi-token    (verification, chunked continuation): row j of a Q-row
    block with global length G sees local(G-(Q-1-j)) tokens -- computed from the
    GLOBAL bound, never as an offset in local coordinates (DESIGN §2);
  * non-causal block      (DSpark/DFlash drafts): every row sees local(G).
Every decode row's visible count on this rank is precomputed once per step in
`MLACommonDecodeMetadata.row_seq_lens`, so all backends share one geometry.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Iterable

import numpy as np
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import CommonAttentionMetadata
# The prefill metadata and attention live in prefill.py (chunked context, no L x L).
from vllm.v1.attention.backends.mla.prefill import (DEFAULT_CONTEXT_CHUNK_TOKENS,
                                                    FlashInferPrefillState,
                                                    MLACommonPrefillMetadata,
                                                    build_prefill_metadata)
from vllm.v1.attention.backends.mla.row_seq_lens import row_seq_lens_triton

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
MLA_HEAD_SIZE = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576


def dcp_local_lengths(global_lens: torch.Tensor, dcp_size: int, dcp_rank: int,
                      interleave: int) -> torch.Tensor:
    """Rank-local lengths through the foundation's geometry (identity when DCP == 1)."""
    if dcp_size == 1:
        return global_lens
    from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens  # foundation owns the formula
    return get_dcp_local_seq_lens(global_lens, dcp_size, dcp_rank, interleave)


def uniform_query_block(query_lens: list[int]) -> tuple[int, int, bool]:
    """(Q, num_active, uniform) of decode query lengths: Q is the first active row's length,
    num_active the number of rows with queries; uniform when the active rows come first, all of
    length Q, followed only by zero-length padding rows. (0, 0, True) when no row is active."""
    active = [n for n in query_lens if n > 0]
    if not active:
        return 0, 0, True
    q, num_active = active[0], len(active)
    uniform = (all(n == q for n in query_lens[:num_active])
               and all(n == 0 for n in query_lens[num_active:]))
    return q, num_active, uniform


class MLADecodeKind(str, Enum):
    """The three decode shapes every MLA backend must serve (module docstring)."""

    CAUSAL_SINGLE = "causal_single"        # Q == 1
    CAUSAL_MULTI = "causal_multi"          # verification / varlen continuation, causal in-block
    NON_CAUSAL_BLOCK = "non_causal_block"  # DSpark / DFlash draft block


@dataclass
class MLACommonDecodeMetadata:
    block_table: torch.Tensor            # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor               # [num_decodes] rank-local under DCP, global otherwise
    dcp_tot_seq_lens: torch.Tensor | None  # [num_decodes] global lengths under DCP, else None
    query_start_loc: torch.Tensor        # [num_decodes+1] device
    max_query_len: int                   # Q
    max_seq_len: int                     # upper bound of seq_lens (rank-local under DCP)
    causal: bool
    # --- additions (backwards-compatible) shared by every backend ---
    query_start_loc_cpu: torch.Tensor | None = None  # [num_decodes+1] host
    num_decode_tokens: int = 0
    row_seq_lens: torch.Tensor | None = None  # [num_decode_tokens] int32 visible local KV per row
    dcp_world_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    backend_state: Any = None            # per-step state a backend attaches (FlashInfer plan)
    row_seq_lens_cpu: torch.Tensor | None = None  # host twin of row_seq_lens (for planners)
    row_req: torch.Tensor | None = None  # [num_decode_tokens] int64 decode row of every token
    row_pos: torch.Tensor | None = None  # [num_decode_tokens] int64 index inside its row
    block_table_cpu: torch.Tensor | None = None  # host twin of block_table (for planners)
    num_blocks_cpu: np.ndarray | None = None  # [num_decodes] pages each table row holds
    cudagraph: bool = False  # built for a CUDA-graph capture/replay (fixed shapes)

    @property
    def kind(self) -> MLADecodeKind:
        if not self.causal:
            return MLADecodeKind.NON_CAUSAL_BLOCK
        return MLADecodeKind.CAUSAL_SINGLE if self.max_query_len <= 1 else MLADecodeKind.CAUSAL_MULTI


@dataclass
class MLACommonMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    causal: bool
    decode: MLACommonDecodeMetadata | None
    prefill: MLACommonPrefillMetadata | None
    num_prefill_tokens: int = 0
    # which build of its builder this is (MLACommonMetadataBuilder.advance_graph_step: only
    # the builder's latest build may carry a later step)
    build_index: int = 0


@dataclass
class _BatchGeometry:
    """MLACommonMetadataBuilder._geometry: what a build derives from the query rows alone."""

    key: tuple
    qsl_np: np.ndarray        # [num_reqs+1] int64 host query_start_loc
    query_lens: np.ndarray    # [num_reqs] int64
    causal: bool
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    max_query_len: int
    multi: bool               # causal multi-token decode rows
    decode_qsl_cpu: torch.Tensor  # [num_decodes+1] int32
    # (live rows, Q) when every live decode row has the same Q tokens (plain decode: Q = 1;
    # verify and draft blocks: Q = 1 + k), the live rows first and only empty padding rows
    # after them, else None
    uniform_rows: tuple[int, int] | None = None


def _spec_is_non_causal(kv_cache_spec: Any) -> bool:
    return bool(getattr(kv_cache_spec, "non_causal_multi_token_decode", False))


class MLACommonMetadataBuilder:
    """Turns CommonAttentionMetadata into MLACommonMetadata for one KV cache group.

    Capabilities are explicit class attributes: the base class claims none, so a
    backend must opt in to non-causal blocks and to DCP variants.
    """

    supports_non_causal_multi_token_decode: ClassVar[bool] = False
    supports_non_causal_multi_token_dcp: ClassVar[bool] = False
    supports_dcp_with_varlen: ClassVar[bool] = False
    # Prefill attention kernels: "torch" (reference, any device) or "flashinfer" (ragged
    # prefill; used only when the builder's device is CUDA).
    prefill_backend: ClassVar[str] = "torch"

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device | str, *, dcp_rank: int | None = None):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        parallel = getattr(vllm_config, "parallel_config", None)
        self.dcp_world_size = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
        self.dcp_interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
        # A replicated group (non-DCP drafter under a DCP target) holds the whole context on
        # every rank: it is built exactly as at DCP 1 (global lengths, no merge).
        self.dcp_sharded = bool(getattr(kv_cache_spec, "dcp_sharded", True))
        if not self.dcp_sharded:
            self.dcp_world_size, dcp_rank = 1, 0
        if dcp_rank is None:
            from vllm.distributed.parallel_state import get_dcp_group
            group = get_dcp_group()
            dcp_rank = group.rank_in_group if group.world_size == self.dcp_world_size else 0
        if not 0 <= dcp_rank < self.dcp_world_size:
            raise ValueError(f"dcp_rank={dcp_rank} must lie in [0, {self.dcp_world_size}).")
        self.dcp_rank = dcp_rank
        block_size = getattr(kv_cache_spec, "block_size", None)
        if block_size is not None and block_size % self.dcp_interleave != 0:
            raise ValueError(f"block_size={block_size} must be a multiple of "
                             f"cp_kv_cache_interleave_size={self.dcp_interleave}.")
        self.non_causal_group = _spec_is_non_causal(kv_cache_spec)
        # Rows with query length <= this are decode rows (absorbed path); longer rows are
        # prefill rows, with or without cached context. The runner sets 1 + num_spec_tokens.
        self.reorder_batch_threshold = 1
        # Context tokens per prefill pass (bounds the gathered K/V and every score tile).
        self.prefill_context_chunk_tokens = DEFAULT_CONTEXT_CHUNK_TOKENS
        self._prefill_fi_state: FlashInferPrefillState | None = None

    # ---------------------------------------------------------------- checks
    def _check_non_causal(self, cm: CommonAttentionMetadata, query_lens: np.ndarray) -> int:
        """Validate a non-causal build; returns the uniform block length Q."""
        name = type(self).__name__
        if not (self.supports_non_causal_multi_token_decode and self.non_causal_group):
            raise ValueError(
                f"{name}: non-causal multi-token decode must be explicitly supported by the "
                f"builder (supports_non_causal_multi_token_decode="
                f"{self.supports_non_causal_multi_token_decode}) and enabled on the KV cache "
                f"group (non_causal_multi_token_decode={self.non_causal_group}); use a backend "
                f"that supports it and mark the draft layers' MLAAttentionSpec.")
        if self.dcp_world_size > 1 and not self.supports_non_causal_multi_token_dcp:
            raise ValueError(
                f"{name}: non-causal multi-token decode under DCP "
                f"(decode_context_parallel_size={self.dcp_world_size}) is not explicitly "
                f"supported by this builder; use another backend or "
                f"decode_context_parallel_size=1.")
        lens = query_lens.tolist()
        q, _, uniform = uniform_query_block(lens)
        # Active rows first, all of length Q; only trailing zero-length padding rows.
        if not uniform:
            raise ValueError(
                f"{name}: non-causal multi-token decode requires a uniform query block (every "
                f"active row of the same length, zero-length padding rows only at the end); "
                f"got query lengths {lens}.")
        return q

    # ---------------------------------------------------------------- build
    @staticmethod
    def _host_seq_lens(cm: CommonAttentionMetadata) -> np.ndarray:
        """Exact global lengths on the host (a numpy view): the runner's pinned twin. Device
        lengths are never read back (that would be a host sync per step); CPU tensors are host
        memory already."""
        if cm.seq_lens_cpu is not None:
            return cm.seq_lens_cpu[: cm.num_reqs].numpy()
        if cm.seq_lens.device.type != "cpu":
            raise ValueError("CommonAttentionMetadata.seq_lens_cpu is required for device "
                             "batches: builders read host twins and never sync on seq_lens.")
        return cm.seq_lens[: cm.num_reqs].numpy()

    def _geometry(self, cm: CommonAttentionMetadata) -> "_BatchGeometry":
        """The batch split and decode-row shape, which follow from the host query_start_loc
        (and the causal flag, the decode threshold and the token count) alone. A decode-only
        geometry is kept: steady decode repeats it every step, and recomputing it is a dozen
        numpy calls."""
        num_reqs = cm.num_reqs
        qsl_view = cm.query_start_loc_cpu[: num_reqs + 1].numpy()
        causal = bool(cm.causal)
        key = (qsl_view.dtype.char, qsl_view.tobytes(), causal,
               int(self.reorder_batch_threshold), int(cm.num_actual_tokens))
        held = getattr(self, "_held_geometry", None)
        if held is not None and held.key == key:
            return held
        # Host arithmetic in numpy on zero-copy views of the host twins: this runs every step,
        # and each torch op on a tiny CPU tensor costs several times a numpy call.
        qsl_np = qsl_view.astype(np.int64)
        query_lens = qsl_np[1:] - qsl_np[:-1]  # np.diff costs several times this
        if not causal:
            self._check_non_causal(cm, query_lens)
            num_decodes = num_reqs  # every row (padding included) is one block
        else:
            num_decodes = self._count_decodes(cm, query_lens)
        num_prefills = int(np.count_nonzero(query_lens[num_decodes:]))
        num_decode_tokens = int(qsl_np[num_decodes])
        if num_prefills == 0:
            # CUDA-graph padding tokens past the last row belong to the decode part (upstream
            # counts the padded total: [0, 8, 16, 16] with 24 tokens -> 24).
            num_decode_tokens = max(num_decode_tokens, int(cm.num_actual_tokens))
        num_prefill_tokens = int(qsl_np[num_decodes + num_prefills]) - int(qsl_np[num_decodes])
        max_query_len = int(query_lens[:num_decodes].max()) if num_decodes else 0
        multi = causal and max_query_len > 1
        uniform = self._uniform_rows(qsl_np, max_query_len, num_decodes)
        geo = _BatchGeometry(
            key=key, qsl_np=qsl_np, query_lens=query_lens, causal=causal,
            num_decodes=num_decodes, num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens, num_prefill_tokens=num_prefill_tokens,
            max_query_len=max_query_len, multi=multi,
            decode_qsl_cpu=torch.from_numpy(qsl_np[: num_decodes + 1].astype(np.int32)),
            uniform_rows=uniform)
        # kept only without prefill rows: the prefill path gets fresh arrays every step
        self._held_geometry = geo if num_prefills == 0 else None
        return geo

    # Builds made so far (each build rewrites the builder's persistent row buffers and may
    # re-plan its wrappers): advance_graph_step accepts only the latest build's metadata.
    builds = 0

    def build(self, common_prefix_len: int,
              common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata:
        cm = common_attn_metadata
        self.builds += 1
        geo = self._geometry(cm)
        seq_lens_host = self._host_seq_lens(cm)
        num_decodes, num_prefills = geo.num_decodes, geo.num_prefills
        decode = None
        if num_decodes > 0:
            decode = self._build_decode(cm, geo, seq_lens_host)
        prefill = None
        if num_prefills > 0:
            prefill = self._build_prefill(cm, num_decodes, num_prefills, geo.num_decode_tokens,
                                          torch.from_numpy(geo.qsl_np))
        return MLACommonMetadata(
            num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes, num_decode_tokens=geo.num_decode_tokens,
            num_prefills=num_prefills, causal=geo.causal, decode=decode, prefill=prefill,
            num_prefill_tokens=geo.num_prefill_tokens, build_index=self.builds)

    def advance_graph_step(self, metadata: MLACommonMetadata, seq_lens_np: np.ndarray) -> bool:
        """Carry `metadata`, built for an earlier CUDA-graph decode step, over to this step in
        place of a new build, when the rows are the same requests with the same query rows
        and only their lengths grew (the runner checks the rows; `seq_lens_np` are this
        step's exact host lengths, one per batch row, and the device `seq_lens` the metadata
        aliases already hold them). Why: a graph replay reads nothing of the metadata on the
        host; what the build would change is the device row lengths (one op here, from the
        device lengths) and, for a backend with host plans, the plan's lengths
        (`_advance_plan`). Valid only while this builder has built nothing since (`builds`:
        its persistent row buffers still hold that build's layout, its plans that build's),
        for decode-only graph metadata with uniform rows at DCP 1. False, changing nothing,
        otherwise; the caller then builds."""
        decode = metadata.decode
        if (decode is None or metadata.num_prefills or not decode.cudagraph
                or metadata.build_index != self.builds or self.dcp_world_size != 1
                or getattr(self, "_row_layout_key", None) is None):
            return False
        if not self._advance_plan(metadata, seq_lens_np):
            return False
        self._rewrite_uniform_rows(decode.seq_lens)
        return True

    def _advance_plan(self, metadata: MLACommonMetadata, seq_lens_np: np.ndarray) -> bool:
        """advance_graph_step's backend part: bring host-planned state to the new lengths
        (False: it cannot, nothing changed). The base builder plans nothing on the host; every
        length its kernels read is the device row lengths, and a graph step's shapes come
        from the capture's bound (max_seq_len = max_model_len), not from the lengths."""
        return True

    def _rewrite_uniform_rows(self, lens: torch.Tensor) -> None:
        """Rewrite the live rows' lengths of the uniform layout the last row write left in
        the persistent buffers (`_row_layout_key`; request and in-block index and the padding
        tail stay): one torch op (see _row_seq_lens)."""
        live, q, causal = self._row_layout_key[2:5]
        view, offsets = self._row_layout_view
        lens = lens if lens.shape[0] == live else lens[:live]
        if q == 1:
            view.copy_(lens)
        elif causal:
            torch.sub(lens.unsqueeze(1), offsets, out=view)
        else:
            view.copy_(lens.unsqueeze(1).expand(live, q))

    def _count_decodes(self, cm: CommonAttentionMetadata, query_lens: np.ndarray) -> int:
        """Leading rows with query length <= reorder_batch_threshold (decode rows); all rows
        when no row is longer. Decided on host query lengths alone (no device read). Every
        row from the first long one on is a prefill row: the prefill path is exact for any
        row (short, with or without context), so a short row the runner left after a prefill
        (e.g. a 1-token prompt) is served there rather than rejected."""
        is_prefill = query_lens > int(self.reorder_batch_threshold)
        first = int(is_prefill.argmax()) if len(is_prefill) else 0
        if len(is_prefill) == 0 or not is_prefill[first]:
            return cm.num_reqs
        return first

    def _build_prefill(self, cm: CommonAttentionMetadata, num_decodes: int, num_prefills: int,
                       num_decode_tokens: int, qsl_cpu: torch.Tensor) -> MLACommonPrefillMetadata:
        backend, state = "torch", None
        if self.prefill_backend == "flashinfer" and self.device.type == "cuda":
            if self._prefill_fi_state is None:
                self._prefill_fi_state = FlashInferPrefillState(self.device)
            backend, state = "flashinfer", self._prefill_fi_state
        meta = build_prefill_metadata(
            cm, num_decodes, num_prefills, num_decode_tokens, qsl_cpu,
            dcp_world_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
            dcp_interleave=self.dcp_interleave,
            block_size=getattr(self.kv_cache_spec, "block_size", None),
            context_chunk_tokens=int(self.prefill_context_chunk_tokens),
            backend=backend, backend_state=state)
        if state is not None:
            state.begin_step(meta)
        return meta

    @staticmethod
    def _alias(t: torch.Tensor, n: int) -> torch.Tensor:
        # Keep the very same tensor object when nothing is cut, so the metadata
        # aliases the runner's persistent buffers (CUDA graphs read them in place).
        return t if t.shape[0] == n else t[:n]

    def _row_buffers(self, num_tokens: int, device: torch.device):
        """Persistent per-builder buffers for row_seq_lens (graph replays read them in place)."""
        buf = getattr(self, "_row_seq_lens_buf", None)
        if buf is None or buf.shape[0] < num_tokens or buf.device != device:
            size = max(num_tokens, 256 if buf is None else 2 * buf.shape[0])
            # Normal (not inference) tensors: builds run both inside and outside inference mode.
            with torch.inference_mode(False):
                self._row_seq_lens_buf = torch.zeros(size, dtype=torch.int32, device=device)
                self._row_req_buf = torch.zeros(size, dtype=torch.int64, device=device)
                self._row_pos_buf = torch.zeros(size, dtype=torch.int64, device=device)
        return self._row_seq_lens_buf, self._row_req_buf, self._row_pos_buf

    def _build_decode(self, cm: CommonAttentionMetadata, geo: "_BatchGeometry",
                      seq_lens_host: np.ndarray) -> MLACommonDecodeMetadata:
        n, r, inter = self.dcp_world_size, self.dcp_rank, self.dcp_interleave
        num_decodes, num_decode_tokens = geo.num_decodes, geo.num_decode_tokens
        global_lens = self._alias(cm.seq_lens, num_decodes)
        if n > 1 and cm.dcp_local_seq_lens is None:
            raise ValueError(
                f"{type(self).__name__}: decode_context_parallel_size={n} needs "
                "CommonAttentionMetadata.dcp_local_seq_lens for decode rows (the rank-local "
                "lengths of THIS batch's seq_lens, from prepare_dcp_local_seq_lens); the builder "
                "does not recompute them, so stale or missing lengths cannot go unnoticed.")
        if n > 1:
            seq_lens, tot = self._alias(cm.dcp_local_seq_lens, num_decodes), global_lens
            max_seq_len = -(-cm.max_seq_len // (n * inter)) * inter
        else:
            seq_lens, tot, max_seq_len = global_lens, None, cm.max_seq_len
        qsl_dev = self._alias(cm.query_start_loc, num_decodes + 1)
        row_seq_lens, row_req, row_pos = self._row_seq_lens(
            cm, num_decodes, num_decode_tokens, geo.multi, seq_lens,
            uniform_rows=geo.uniform_rows)
        row_host = self._row_seq_lens_host(cm, num_decodes, num_decode_tokens, geo.qsl_np,
                                           geo.multi, seq_lens_host, geo.query_lens,
                                           geo.uniform_rows)
        return MLACommonDecodeMetadata(
            block_table=self._alias(cm.block_table_tensor, num_decodes),
            seq_lens=seq_lens, dcp_tot_seq_lens=tot, query_start_loc=qsl_dev,
            max_query_len=geo.max_query_len,
            max_seq_len=max_seq_len, causal=geo.causal,
            # the geometry's own int32 copy, shared by the steps of this geometry (read-only)
            query_start_loc_cpu=geo.decode_qsl_cpu,
            num_decode_tokens=num_decode_tokens, row_seq_lens=row_seq_lens,
            dcp_world_size=n, dcp_rank=r, dcp_interleave=inter,
            row_seq_lens_cpu=row_host, row_req=row_req, row_pos=row_pos,
            block_table_cpu=(None if cm.block_table_cpu is None
                             else cm.block_table_cpu[:num_decodes]),
            num_blocks_cpu=(None if cm.num_blocks_cpu is None
                            else cm.num_blocks_cpu[:num_decodes]),
            cudagraph=bool(cm.cudagraph))

    @staticmethod
    def _uniform_rows(qsl_np: np.ndarray, max_query_len: int,
                      num_decodes: int) -> tuple[int, int] | None:
        """(live rows, Q) when the decode rows are uniform blocks of Q >= 1 tokens: the first
        `live` rows Q tokens each, then only zero-length padding rows. None otherwise."""
        q = int(max_query_len)
        if q < 1 or num_decodes == 0:
            return None
        total = int(qsl_np[num_decodes])
        live = total // q
        if total % q or not 0 < live <= num_decodes:
            return None
        if not (np.array_equal(qsl_np[: live + 1], np.arange(live + 1) * q)
                and bool((qsl_np[live: num_decodes + 1] == total).all())):
            return None
        return live, q

    def _row_seq_lens(self, cm: CommonAttentionMetadata, num_decodes: int,
                      num_tokens: int, causal: bool, local_seq_lens: torch.Tensor,
                      uniform_rows: tuple[int, int] | None = None):
        """Visible KV count on this rank for every decode query row (device, int32), plus the
        request and in-block index of every row; written into persistent buffers, no host sync.

        A row that sees the whole sequence (every non-causal row, and the last row of a causal
        block) reads the rank-local length handed in by the caller (`local_seq_lens`, i.e.
        CommonAttentionMetadata.dcp_local_seq_lens under DCP): those are the lengths the
        runner/speculator is responsible for keeping current, exactly what the sm100 kernel
        reads too. Only the earlier rows of a causal block need a bound below the sequence end,
        and that bound is taken from GLOBAL positions (DESIGN §2), never as an offset in local
        coordinates. `causal` is False for single-token batches too: every row is then the
        last row of its block, so the causal bound equals the whole length. Tokens past the last
        row (CUDA-graph padding) see nothing (0).
        """
        device = cm.seq_lens.device
        out, req_buf, pos_buf = self._row_views(num_tokens, device)
        if num_decodes == 0 or num_tokens == 0:
            out.zero_()
            self._row_layout_key = None
            return out, req_buf, pos_buf
        # Uniform rows with the layout of the last write (live blocks of Q tokens first, then
        # only empty padding rows; steady plain decode: Q = 1, a DSpark step's verify and draft
        # groups: Q = 1 + k): req, pos and the zero tail of the padding tokens are still in the
        # buffers, so only the live rows' lengths move, in one torch op (a Triton launch costs
        # the host several times that: docs/performance.md, fourteenth and twentieth
        # sessions). A one-token row and every row of a non-causal block see the request's
        # whole rank-local length; row j of a causal block sees G - (Q-1-j) global positions,
        # a length on this rank only without DCP (under DCP causal blocks take the kernel).
        key = None
        if uniform_rows is not None and (not causal or (
                self.dcp_world_size == 1 and local_seq_lens.dtype == out.dtype)):
            live, q = uniform_rows
            key = (num_decodes, num_tokens, live, q, causal, out.data_ptr())
            if getattr(self, "_row_layout_key", None) == key:
                self._rewrite_uniform_rows(local_seq_lens)
                return out, req_buf, pos_buf
        # Any other write leaves the buffers in another layout: the shortcut waits for the next
        # step written in full.
        self._row_layout_key = None
        if device.type == "cuda" and HAS_TRITON:
            # One launch instead of the dozen below (the decode step is host-bound).
            row_seq_lens_triton(out, req_buf, pos_buf, cm.query_start_loc, local_seq_lens,
                                cm.seq_lens, num_decodes, num_tokens, causal,
                                self.dcp_world_size, self.dcp_rank, self.dcp_interleave)
        else:
            self._row_seq_lens_torch(cm, num_decodes, num_tokens, causal, local_seq_lens, out,
                                     req_buf, pos_buf)
        if key is not None:
            live, q = uniform_rows
            with torch.inference_mode(False):  # kept across builds in and out of inference mode
                if q == 1:
                    view, offsets = (out[:live] if live != num_tokens else out), None
                else:
                    view = out[: live * q].view(live, q)
                    offsets = torch.arange(q - 1, -1, -1, dtype=out.dtype, device=device)
            self._row_layout_view = (view, offsets)
            self._row_layout_key = key
        return out, req_buf, pos_buf

    def _row_views(self, num_tokens: int, device: torch.device):
        """The [:num_tokens] views of the persistent row buffers, made once per size (a torch
        slice costs the host ~1.5 us; the decode step has the same size every step)."""
        buf = self._row_buffers(num_tokens, device)
        cache = getattr(self, "_row_view_cache", None)
        if cache is None or cache[0] is not buf[0]:  # (re)allocated buffers: new views
            cache = self._row_view_cache = (buf[0], {})
        views = cache[1].get(num_tokens)
        if views is None:
            views = cache[1][num_tokens] = tuple(t[:num_tokens] for t in buf)
        return views

    def _row_seq_lens_torch(self, cm: CommonAttentionMetadata, num_decodes: int,
                            num_tokens: int, causal: bool, local_seq_lens: torch.Tensor, out,
                            req_buf, pos_buf) -> None:
        """The torch form of row_seq_lens_triton (CPU and Triton-less devices)."""
        device = cm.seq_lens.device
        qsl = cm.query_start_loc[: num_decodes + 1].to(device=device, dtype=torch.int64)
        tok = torch.arange(num_tokens, device=device)
        req = torch.searchsorted(qsl[1:], tok, right=True)
        live = req < num_decodes
        req = req.clamp(max=num_decodes - 1)
        req_buf.copy_(req)
        pos_buf.copy_(tok - qsl[req])
        whole = local_seq_lens[:num_decodes].to(device=device, dtype=torch.int64)[req]
        if causal:
            # row j of a Q-row block sees global positions < G - (Q-1-j)
            qlen = qsl[1:] - qsl[:-1]
            offset = qlen[req] - 1 - pos_buf
            global_len = cm.seq_lens[:num_decodes].to(device=device, dtype=torch.int64)[req]
            bounded = dcp_local_lengths(global_len - offset, self.dcp_world_size, self.dcp_rank,
                                        self.dcp_interleave)
            whole = torch.where(offset > 0, bounded.to(torch.int64), whole)
        out.copy_(torch.where(live, whole, torch.zeros_like(whole)))

    def _row_seq_lens_host(self, cm: CommonAttentionMetadata, num_decodes: int, num_tokens: int,
                           qsl_cpu: np.ndarray, causal: bool,
                           seq_lens_host: np.ndarray,
                           query_lens: np.ndarray | None = None,
                           uniform_rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Host twin of row_seq_lens for host planners, from host twins only (numpy: this runs
        on the host every step)."""
        n, r, inter = self.dcp_world_size, self.dcp_rank, self.dcp_interleave
        out = np.zeros(num_tokens, dtype=np.int32)
        if num_decodes == 0:
            return torch.from_numpy(out)
        if uniform_rows is not None and (n == 1 or (
                not causal and cm.dcp_local_seq_lens_cpu is not None)):
            # Uniform Q-token blocks (plain decode: Q = 1; a DSpark step's verify and draft
            # groups): one broadcast instead of the general path's repeat / gather / offset
            # arrays (the rule of _row_seq_lens' shortcut: a causal block's row j sees
            # G - (Q-1-j), without DCP only; every row of a one-token or non-causal block sees
            # its request's rank-local length, under DCP from the local twin).
            live, q = uniform_rows
            rows = out[: live * q].reshape(live, q)
            if causal:
                rows[:] = seq_lens_host[:live, None] - np.arange(q - 1, -1, -1)
            else:
                lens = seq_lens_host if n == 1 else cm.dcp_local_seq_lens_cpu[:live].numpy()
                rows[:] = lens[:live, None]
            return torch.from_numpy(out)
        qsl = qsl_cpu[: num_decodes + 1]
        live = int(qsl[-1])
        glob = seq_lens_host[:num_decodes]
        qlen = qsl[1:] - qsl[:-1] if query_lens is None else query_lens[:num_decodes]
        req = np.repeat(np.arange(num_decodes), qlen)
        if causal:
            offset = qlen[req] - 1 - (np.arange(live) - qsl[req])
            g = glob[req] - offset
        else:
            g = glob[req]
        if n > 1:
            if cm.dcp_local_seq_lens_cpu is not None and not causal:
                out[:live] = cm.dcp_local_seq_lens_cpu[:num_decodes].numpy()[req]
            else:
                # the foundation's formula, on a zero-copy view of the host array
                out[:live] = dcp_local_lengths(torch.from_numpy(g.astype(np.int64)), n, r,
                                               inter).numpy()
        else:
            out[:live] = g
        return torch.from_numpy(out)


# ---------------------------------------------------------------------- impl
class MLACommonImpl:
    """Absorbed MLA decode: q [T, H, 576] against the latent cache [blocks, bs, 576]."""

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int = KV_LORA_RANK,
                 qk_rope_head_dim: int = QK_ROPE_HEAD_DIM, **kwargs: Any):
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim

    def _check_decode_inputs(self, q: torch.Tensor, kv_cache: torch.Tensor,
                             decode_meta: MLACommonDecodeMetadata) -> None:
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if q.dim() != 3 or q.shape[-1] != width:
            raise ValueError(f"forward_decode: q must be [T, H, {width}], got {tuple(q.shape)}.")
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(f"forward_decode: kv_cache must be [blocks, block_size, {width}], "
                             f"got {tuple(kv_cache.shape)}.")
        if q.shape[0] != decode_meta.num_decode_tokens:
            raise ValueError(f"forward_decode: q has {q.shape[0]} tokens but the decode metadata "
                             f"has {decode_meta.num_decode_tokens}; pass q[:num_decode_tokens].")

    def forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       decode_meta: MLACommonDecodeMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


# ------------------------------------------------------- start-up validation
def validate_dspark_dcp_backends(speculative_method: str | None,
                                 decode_context_parallel_size: int,
                                 group_builders: Iterable[tuple[Any, type]]) -> None:
    """Reject, at start-up, DSpark+DCP KV cache groups whose builder cannot serve them.

    group_builders: (kv_cache_spec or bool non_causal flag, builder class) per KV cache group.
    Non-causal (draft) groups need supports_non_causal_multi_token_dcp; causal (target)
    groups need supports_dcp_with_varlen (verification is varlen multi-token under DCP).
    """
    if speculative_method != "dspark" or decode_context_parallel_size <= 1:
        return
    n = decode_context_parallel_size
    for spec, builder_cls in group_builders:
        if not isinstance(spec, bool) and not getattr(spec, "dcp_sharded", True):
            continue  # replicated draft KV: served like DCP 1, no DCP capability needed
        non_causal = spec if isinstance(spec, bool) else _spec_is_non_causal(spec)
        name = builder_cls.__name__
        if non_causal and not getattr(builder_cls, "supports_non_causal_multi_token_dcp", False):
            raise ValueError(
                f"DSpark with decode_context_parallel_size={n}: the non-causal draft KV cache "
                f"group uses {name}, which does not declare supports_non_causal_multi_token_dcp. "
                f"Choose another attention backend (FLASHINFER_MLA or TORCH_MLA) or set "
                f"decode_context_parallel_size=1.")
        if not non_causal and not getattr(builder_cls, "supports_dcp_with_varlen", False):
            raise ValueError(
                f"DSpark with decode_context_parallel_size={n}: the causal target KV cache "
                f"group uses {name}, which does not declare supports_dcp_with_varlen "
                f"(verification runs multi-token causal decode under DCP). Choose another "
                f"attention backend (FLASHINFER_MLA or TORCH_MLA) or set "
                f"decode_context_parallel_size=1.")
