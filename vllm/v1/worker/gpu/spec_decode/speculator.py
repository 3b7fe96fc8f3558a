"""The shared speculator base: draft buffers and the DCP-aware draft attention-metadata builder.

Every draft forward (EAGLE/MTP steps, DFlash/DSpark blocks) describes its batch with the draft's
OWN global seq_lens, which advance every autoregressive step and roll back to the accepted prefix
at the next engine step. Rank-local lengths computed for the target are therefore stale for the
draft (DESIGN §6 worked example); `_build_draft_attn_metadata` recomputes them from the draft's
seq_lens for all speculators, so no speculator carries a private copy of that logic.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
# Module attribute on purpose: tests patch `speculator.prepare_dcp_local_seq_lens`.
from vllm.v1.worker.gpu.cp_utils import dcp_local_seq_lens_np, prepare_dcp_local_seq_lens
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.spec_decode.block_inputs import BlockInputBuffers, write_block_inputs


@dataclass
class DraftInputs:
    """The target step as the speculator needs it, after verification.

    Token rows follow the target batch (decode rows first, prefills after). For request i:
    `num_computed_new[i]` = accepted prefix length = position of its anchor `next_token_ids[i]`
    (the bonus/corrected token, not yet in any cache); `last_accepted_index[i]` = flat index in
    the target batch of the token at position num_computed_new[i] - 1.
    """

    num_reqs: int
    query_start_loc_np: np.ndarray          # [num_reqs + 1] target query starts (host)
    target_input_ids: torch.Tensor          # [T]
    target_positions: torch.Tensor          # [T]
    target_hidden_states: torch.Tensor      # [T, D] final hidden states of the target
    target_seq_lens_cpu: torch.Tensor       # [num_reqs] int32: upper bound of every draft seq_len
    num_computed_new: np.ndarray            # [num_reqs] int64 (host)
    last_accepted_index: torch.Tensor | None  # [num_reqs] int64 (None: speculator needs none)
    next_token_ids: torch.Tensor            # [num_reqs] int64 anchors
    aux_hidden_states: torch.Tensor | None = None  # [T, k*D] tapped target layers (block drafters)
    sampling_metadata: Any = None  # the step's SamplingMetadata (rows = requests); probabilistic drafts
    # Device twins filled by the runner (no host->device copy of host arrays inside propose);
    # unit tests on CPU may leave them None and the host arrays are used.
    num_computed_new_dev: torch.Tensor | None = None   # [num_reqs] int64
    target_seq_lens: torch.Tensor | None = None        # [num_reqs] int32 device
    slots: torch.Tensor | None = None  # [num_reqs] request slot per row (None: row == slot)

    def accepted_on_device(self, device: torch.device) -> torch.Tensor:
        if self.num_computed_new_dev is not None:
            return self.num_computed_new_dev[: self.num_reqs]
        return torch.as_tensor(np.asarray(self.num_computed_new), dtype=torch.int64,
                               device=device)

    def target_seq_lens_on_device(self, device: torch.device) -> torch.Tensor:
        if self.target_seq_lens is not None:
            return self.target_seq_lens[: self.num_reqs]
        return self.target_seq_lens_cpu[: self.num_reqs].to(device)


class Speculator:
    """Base of the four speculators; subclasses implement `propose`."""

    # May the runner skip propose() in a step after which nobody drafts? Not for EAGLE/MTP:
    # their first draft pass writes the draft KV of the step's tokens, which later drafts read.
    can_skip_propose = False
    # Does propose() read DraftInputs.last_accepted_index? (the runner skips its copy if not)
    needs_last_accepted_index = True

    def __init__(self, vllm_config: Any, device: torch.device | str, block_tables: Any,
                 max_num_reqs: int, max_num_tokens: int):
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.block_tables = block_tables
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        spec_config = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec_config.num_speculative_tokens) if spec_config else 1
        self.draft_sample_method = getattr(spec_config, "draft_sample_method", "greedy")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"draft_sample_method={self.draft_sample_method!r} is invalid; use "
                             "'greedy' or 'probabilistic'.")
        # q of every draft, persistent and slot-indexed ([max_num_reqs, k, V] float32, allocated
        # on the first probabilistic draft): propose() returns it for rejection sampling; None
        # when drafts were chosen greedily (q is then one-hot on the draft).
        self.draft_probs_buffer: torch.Tensor | None = None
        self._probs_written = False
        self._slots: torch.Tensor | None = None
        self._sampling_metadata: Any = None
        # The draft's own buffers: its seq_lens differ from the target's every draft step.
        self.input_buffers = InputBuffers(max_num_reqs, max_num_tokens, self.device)
        # Host upper bound of the draft seq_lens (metadata aliases it, like the other buffers),
        # and the exact host draft lengths; numpy views are written in place each draft step
        # (one metadata build is consumed before the next one rewrites them).
        self.seq_lens_cpu_upper_bound = torch.zeros(max_num_reqs, dtype=torch.int32)
        self._upper_bound_np = self.seq_lens_cpu_upper_bound.numpy()
        self._seq_lens_cpu = torch.zeros(max_num_reqs, dtype=torch.int32)
        self._seq_lens_cpu_np = self._seq_lens_cpu.numpy()
        # Host twin of the rank-local draft lengths (DCP), written in numpy each build.
        self._dcp_local_cpu = torch.zeros(max_num_reqs, dtype=torch.int32)
        self._dcp_local_cpu_np = self._dcp_local_cpu.numpy()
        # (num_reqs, num_reqs_padded, Q) of the uniform query starts last copied to the device
        # (block drafters: the same every step, so neither the host write nor the copy recurs).
        self._uniform_qsl_key: tuple[int, int, int] | None = None
        # The drafter's OWN DCP geometry. `block_tables` is shared with the target, so its
        # cp_size is the target's: a replicated drafter (draft_decode_context_parallel_size=1
        # under a DCP target) must not recompute rank-local lengths from it.
        own = getattr(spec_config, "draft_decode_context_parallel_size", None)
        self.dcp_size = int(block_tables.cp_size if own is None else own)
        if self.dcp_size not in (1, block_tables.cp_size):
            raise ValueError(
                f"draft_decode_context_parallel_size={self.dcp_size} is invalid with the target's "
                f"decode_context_parallel_size={block_tables.cp_size}; set it to 1 or "
                f"{block_tables.cp_size}.")
        self.dcp_rank = block_tables.cp_rank if self.dcp_size > 1 else 0
        self.dcp_interleave = block_tables.cp_interleave
        self.model: Any = None  # the drafter, set by the runner after loading it
        self.cudagraphs: Any = None  # CudaGraphManager of the draft step (block drafters)
        self.kv_cache_config: Any = None
        self.attn_metadata_builders: list[Any] = []
        self.group_ids: tuple[int, ...] = ()

    # ----------------------------------------------------------------- set-up
    def bind_attention(self, kv_cache_config: Any, attn_metadata_builders: list[Any],
                       group_ids: tuple[int, ...]) -> None:
        """Attach the KV cache groups that hold this drafter's layers (and their builders)."""
        self.kv_cache_config = kv_cache_config
        self.attn_metadata_builders = attn_metadata_builders
        self.group_ids = tuple(group_ids)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states this drafter consumes (none for EAGLE/MTP)."""
        return ()

    def precompute_context(self, aux_hidden_states: torch.Tensor | None,
                           positions: torch.Tensor, defer: bool = False) -> None:
        """Hook run inside the target step's forward context (block drafters store context KV;
        `defer`: only queue it, see context_kv_ring.py)."""

    # Deferred context KV (block drafters with VLLM_DEFER_DRAFT_CONTEXT_KV=1; context_kv_ring.py).
    defers_context = False

    def flush_context(self) -> bool:
        """Write the queued context KV now (nothing queued: False)."""
        return False

    def early_draft_lengths_exact(self) -> bool:
        """Whether a draft step prepared from upper-bound host lengths (early_draft.py) becomes
        exact by lowering its planned lengths alone. Not under DCP: the rank-local lengths the
        base recomputes in _build_draft_attn_metadata come from the exact host lengths, and
        lowering global lengths does not lower them rank by rank."""
        return self.dcp_size == 1

    def consume_early_launch(self) -> torch.Tensor | None:
        """This step's proposal when prepare_early launched the draft step already: its
        drafts (counted, and the early step consumed), else None and nothing changes."""
        return None

    def discard_early(self) -> None:
        """Forget a draft step prepared early (early_draft.py) that no proposal consumed."""
        self.__dict__.pop("_early", None)

    def propose(self, inputs: DraftInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (drafts [num_reqs, k], the slot-indexed q buffer or None for greedy drafts)."""
        drafts = self._propose(inputs)
        return drafts, (self.draft_probs_buffer if self._probs_written else None)

    def _propose(self, inputs: DraftInputs) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _propose()")

    # ------------------------------------------------------- draft choice
    def _begin_drafts(self, inputs: DraftInputs) -> None:
        self._probs_written = False
        self._sampling_metadata = inputs.sampling_metadata
        self._slots = inputs.slots if inputs.slots is not None else torch.arange(
            inputs.num_reqs, device=self.device)

    def _chooses_greedily(self) -> bool:
        """Drafts are argmax choices: greedy drafting, or probabilistic drafting with no
        sampling metadata this step (no q to keep)."""
        return self.draft_sample_method == "greedy" or self._sampling_metadata is None

    def _choose_drafts(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """Draft `index` of every request from logits [num_reqs, V].

        "greedy": argmax. "probabilistic": a sample of q = softmax(logits / T) with the
        request's temperature and generator (greedy requests keep argmax, q one-hot); q is kept
        in `draft_probs` so that verification can accept with min(1, p/q).
        """
        greedy_tokens = logits.argmax(dim=-1)
        if self._chooses_greedily():
            return greedy_tokens
        metadata = self._sampling_metadata
        from vllm.v1.sample.metadata import SAMPLING_EPS
        from vllm.v1.sample.sampler import compute_probs, random_sample
        greedy_rows = metadata.temperature < SAMPLING_EPS
        probs = compute_probs(logits, metadata.temperature, None, None)
        if not metadata.all_random:  # greedy rows: q is one-hot on the argmax
            probs = torch.where(greedy_rows[:, None],
                                torch.nn.functional.one_hot(greedy_tokens, logits.shape[-1]).float(),
                                probs)
        tokens = greedy_tokens
        if not metadata.all_greedy:
            tokens = torch.where(greedy_rows, greedy_tokens,
                                 random_sample(probs, metadata.generators))
        if self.draft_probs_buffer is None:
            with torch.inference_mode(False):
                self.draft_probs_buffer = torch.zeros(
                    self.max_num_reqs, self.num_speculative_tokens, logits.shape[-1],
                    dtype=torch.float32, device=logits.device)
        self.draft_probs_buffer[self._slots[: logits.shape[0]], index] = probs
        self._probs_written = True
        return tokens

    # ------------------------------------------------------- uniform draft rows
    def _uniform_buffers(self, q: int) -> BlockInputBuffers:
        """The fused uniform-row write's buffers (block_inputs.py): the draft's own input
        buffers, a persistent anchor buffer (kept across re-bindings: captured graphs read it),
        arange(q) and a device copy of the drafter's KV cache group ids (all groups when none
        were bound). Made once per (binding, q)."""
        groups = self.group_ids or tuple(range(self.block_tables.num_kv_cache_groups))
        buffers = self.__dict__.get("_uniform_inputs")
        if (buffers is None or buffers.group_ids_host != groups
                or buffers.offsets.shape[0] != q):
            with torch.inference_mode(False):
                anchors = (torch.zeros(self.max_num_reqs, dtype=torch.int64, device=self.device)
                           if buffers is None else buffers.anchors)
                group_ids = torch.tensor(groups, dtype=torch.int32, device=self.device)
                offsets = torch.arange(q, dtype=torch.int64, device=self.device)
            inputs = self.input_buffers
            buffers = self._uniform_inputs = BlockInputBuffers(
                inputs.input_ids, inputs.positions, inputs.seq_lens, anchors, group_ids, groups,
                offsets)
        return buffers

    def _write_uniform_rows(self, num_reqs: int, padded: int, q: int, accepted: torch.Tensor,
                            first_ids: torch.Tensor, start_offset: int = 0,
                            accepted_extra: torch.Tensor | None = None,
                            first_id_rows: torch.Tensor | None = None,
                            lowering: Any = None) -> torch.Tensor:
        """ids[row * q] = first_ids (or first_ids[first_id_rows]), positions, draft seq_lens and
        the drafter groups' slots of `padded` uniform rows of q tokens starting at accepted
        (+ accepted_extra) + start_offset, in one fused write (block_inputs.py); returns the
        slot mappings view for `_build_draft_attn_metadata`. `lowering`: a held draft plan
        whose lengths these rows' seq_lens are, lowered in the same write
        (plan_lowering.PlanLowering)."""
        return write_block_inputs(self.block_tables, self._uniform_buffers(q), num_reqs, padded,
                                  q, accepted, first_ids, self.max_model_len, start_offset,
                                  accepted_extra, first_id_rows, lowering)

    # ------------------------------------------------------- shared metadata
    draft_metadata_builds = 0  # _build_draft_attn_metadata calls so far

    def _build_draft_attn_metadata(
        self,
        num_reqs: int,
        num_reqs_padded: int,
        num_tokens_padded: int,
        seq_lens_cpu_upper_bound: torch.Tensor | np.ndarray,
        step: int,
        num_query_per_req: int | None = None,
        causal: bool | Mapping[int, bool] = True,
        query_start_loc_np: np.ndarray | None = None,
        dcp_local_seq_lens: torch.Tensor | None = None,
        seq_lens_np: np.ndarray | None = None,
        cudagraph: bool = False,
        slot_mappings: torch.Tensor | None = None,
        padding_written: bool = False,
    ) -> dict[str, Any]:
        """Attention metadata of one draft forward, described by the draft's own buffers.

        The caller has written `input_buffers.seq_lens[:num_reqs]` (the draft's global lengths)
        and `input_buffers.positions[:num_tokens_padded]`. Query rows are uniform blocks of
        `num_query_per_req` tokens (row i starts at min(i, num_reqs) * Q, so padding rows are
        empty) unless `query_start_loc_np` gives explicit starts. `step` is what the draft has
        advanced past the target's upper bound: the AR step index, or Q for a block drafter.
        `seq_lens_np` are the exact draft lengths on the host (the runner knows them after its
        one transfer per step); planners read them instead of syncing on the device buffer.
        `slot_mappings`: the caller already wrote the slots of this batch (block drafters'
        fused input write), so they are not computed again; `padding_written`: it also zeroed
        the padding rows' seq_lens. The rank-local DCP lengths are recomputed here either way.
        """
        if not 0 <= num_reqs <= num_reqs_padded <= self.max_num_reqs:
            raise ValueError(
                f"need 0 <= num_reqs ({num_reqs}) <= num_reqs_padded ({num_reqs_padded}) <= "
                f"max_num_reqs ({self.max_num_reqs}).")
        # Counted so metadata kept across steps knows whether the shared buffers below (query
        # starts, host twins) and the builders' were rewritten since (BlockSpeculator's
        # advance of its early plans).
        self.draft_metadata_builds += 1
        buffers = self.input_buffers
        qsl_np = buffers.query_start_loc_np
        if query_start_loc_np is None:
            per_req = 1 if num_query_per_req is None else int(num_query_per_req)
            max_query_len = per_req
            key = (num_reqs, num_reqs_padded, per_req)
            if key != self._uniform_qsl_key:
                # Only this method writes the draft's query starts: unchanged key, unchanged
                # device buffer.
                qsl_np[: num_reqs_padded + 1] = np.minimum(np.arange(num_reqs_padded + 1),
                                                           num_reqs) * per_req
                buffers.query_start_loc[: num_reqs_padded + 1].copy_(
                    buffers.query_start_loc_cpu[: num_reqs_padded + 1], non_blocking=True)
                self._uniform_qsl_key = key
        else:
            self._uniform_qsl_key = None
            qsl_np[: num_reqs_padded + 1] = query_start_loc_np[: num_reqs_padded + 1]
            query_lens = np.diff(qsl_np[: num_reqs_padded + 1])
            max_query_len = int(query_lens.max()) if num_reqs_padded else 0
            buffers.query_start_loc[: num_reqs_padded + 1].copy_(
                buffers.query_start_loc_cpu[: num_reqs_padded + 1], non_blocking=True)
        if int(qsl_np[num_reqs_padded]) > num_tokens_padded:
            raise ValueError(
                f"the draft batch has {int(qsl_np[num_reqs_padded])} query tokens but "
                f"num_tokens_padded={num_tokens_padded}; pass the padded token count.")
        if num_reqs_padded > num_reqs and not padding_written:
            buffers.seq_lens[num_reqs:num_reqs_padded].zero_()

        # Host upper bound of the draft lengths: each step adds at most `step` tokens past the
        # target's bound, and no sequence outgrows max_model_len. Padding rows stay 0.
        upper_bound = self.seq_lens_cpu_upper_bound[:num_reqs_padded]
        upper_np = self._upper_bound_np
        upper_np[num_reqs:num_reqs_padded] = 0
        max_seq_len = 0
        if num_reqs > 0:
            bound = seq_lens_cpu_upper_bound[:num_reqs]
            if isinstance(bound, torch.Tensor):
                bound = bound.numpy()
            np.minimum(np.asarray(bound, dtype=np.int64) + step, self.max_model_len,
                       out=upper_np[:num_reqs], casting="unsafe")
            max_seq_len = int(upper_np[:num_reqs].max())
        if cudagraph:  # graph replays keep the capture's bound (shapes baked into kernels)
            max_seq_len = self.max_model_len

        seq_lens_cpu = None
        if seq_lens_np is not None:
            seq_lens_cpu = self._seq_lens_cpu[:num_reqs_padded]
            self._seq_lens_cpu_np[:num_reqs] = np.asarray(seq_lens_np)[:num_reqs]
            self._seq_lens_cpu_np[num_reqs:num_reqs_padded] = 0
        elif buffers.seq_lens.device.type == "cpu":
            seq_lens_cpu = buffers.seq_lens[:num_reqs_padded]
        # The speculator's own DCP size, not block_tables.cp_size (the target's, shared): a
        # replicated drafter's groups hold the full context and read global lengths.
        cp_size = self.dcp_size
        dcp_local_cpu = None
        if cp_size > 1 and seq_lens_cpu is not None:
            # numpy into the persistent host twin (torch ops on host tensors cost microseconds
            # each; planners read these lengths, the device reads the recomputed buffer below)
            dcp_local_seq_lens_np(seq_lens_cpu.numpy(), cp_size, self.dcp_rank,
                                  self.dcp_interleave, out=self._dcp_local_cpu_np)
            dcp_local_cpu = self._dcp_local_cpu[:num_reqs_padded]
        if dcp_local_seq_lens is None and cp_size > 1:
            # Recompute from the draft's OWN seq_lens into the persistent buffer (DESIGN §6);
            # the target's local lengths would be stale after the draft advanced or rolled back.
            prepare_dcp_local_seq_lens(buffers.dcp_local_seq_lens, buffers.seq_lens, num_reqs,
                                       cp_size, self.dcp_rank, self.dcp_interleave)
            dcp_local_seq_lens = buffers.dcp_local_seq_lens[:num_reqs_padded]

        if slot_mappings is None:
            slot_mappings = self.block_tables.compute_slot_mappings(
                buffers.query_start_loc[: num_reqs_padded + 1],
                buffers.positions[:num_tokens_padded])

        # A bool applies to every built group, and only the drafter's own groups are built.
        return build_attn_metadata(
            attn_metadata_builders=self.attn_metadata_builders,
            kv_cache_config=self.kv_cache_config,
            num_reqs=num_reqs_padded,
            num_tokens=num_tokens_padded,
            query_start_loc=buffers.query_start_loc,
            query_start_loc_cpu=buffers.query_start_loc_cpu,
            seq_lens=buffers.seq_lens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            # Rows gathered for this batch by the runner (batch order = draft row order).
            block_tables=self.block_tables.input_block_tables,
            slot_mappings=slot_mappings,
            causal=causal,
            dcp_local_seq_lens=dcp_local_seq_lens,
            seq_lens_cpu_upper_bound=upper_bound,
            group_ids=self.group_ids,
            seq_lens_cpu=seq_lens_cpu,
            dcp_local_seq_lens_cpu=dcp_local_cpu,
            block_tables_cpu=getattr(self.block_tables, "input_block_tables_cpu", None),
            num_blocks_cpu=getattr(self.block_tables, "input_num_blocks_cpu", None),
            cudagraph=cudagraph,
        )

    def _run_forward(self, attn_metadata: dict[str, Any], fn, *args, **kwargs):
        with set_forward_context(attn_metadata, self.vllm_config):
            return fn(*args, **kwargs)

