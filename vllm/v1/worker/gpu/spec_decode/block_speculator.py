"""Shared machinery of the block drafters (DFlash, DSpark): one non-causal forward per step.

The drafter's layers live in their own non-causal KV cache group. During the target step the
runner hands over the tapped target hidden states so the drafter stores context KV for every
processed position. The block (anchor + masks) sits at positions num_computed_new + arange(Q);
the draft's seq_len is num_computed_new + Q, and its rank-local lengths come from the shared base
builder (no DCP code here). Context KV written for rejected positions is overwritten by the block
(Q >= number of drafts verified) and by the next step's context pass before anything reads it.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.mla_attention import current_attn_metadata
from vllm.utils.env_flags import switch_flag
from vllm.v1.attention.backends.mla.plan_lowering import FusedDraftLowering, PlanLowering
from vllm.v1.worker.gpu.attn_utils import (KVWriteOnlyMetadata, advance_attn_metadata_on_device,
                                           lower_attn_metadata_on_device,
                                           refresh_attn_metadata_seq_lens)
from vllm.v1.worker.gpu.spec_decode.context_kv_ring import (DEFAULT_STEPS, DeferredContextKV,
                                                            deferral_enabled)
from vllm.v1.worker.gpu.spec_decode.early_draft import (FUSED_LOWERING_FLAG, MODES, EarlyDraft,
                                                        EarlyDraftTuner,
                                                        device_lowering_enabled,
                                                        early_draft_mode)
from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs, Speculator


class BlockSpeculator(Speculator):

    # The context KV is written inside the target forward (precompute_context), every step:
    # skipping the block pass loses nothing a later step reads.
    can_skip_propose = True
    # The block needs no target row index (EAGLE/MTP gather the last accepted row's hidden).
    needs_last_accepted_index = False
    _masks_written = 0  # rows of the draft input_ids whose mask columns hold the mask token

    @property
    def query_len(self) -> int:
        """Q: tokens in the draft block."""
        raise NotImplementedError

    def select_drafts(self, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """logits [num_reqs, Q, V] of the block -> drafts [num_reqs, num_speculative_tokens]."""
        raise NotImplementedError

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.model.config.target_layer_ids)

    def precompute_context(self, aux_hidden_states: torch.Tensor | None,
                           positions: torch.Tensor, defer: bool = False) -> None:
        if aux_hidden_states is None:
            raise ValueError(f"{type(self).__name__} needs the target's hidden states at layers "
                             f"{self.aux_hidden_state_layers}; run the target with them.")
        if defer:
            # Queue the rows; the KV is written by flush_context (context_kv_ring.py).
            self._context_ring().append(
                aux_hidden_states, positions,
                [current_attn_metadata(name).slot_mapping for name in self._draft_layer_names()])
            return
        self.model.precompute_context_kv(aux_hidden_states, positions)

    # ---- deferred context KV (opt-in, context_kv_ring.py) ------------------------------------
    @property
    def defers_context(self) -> bool:
        flag = self.__dict__.get("_defers_context")
        if flag is None:
            flag = self.__dict__["_defers_context"] = deferral_enabled()
        return flag

    def _draft_layer_names(self) -> list[str]:
        names = self.__dict__.get("_draft_layer_name_list")
        if names is None:
            names = self.__dict__["_draft_layer_name_list"] = [
                layer.self_attn.layer_name for layer in self.model.model.layers]
        return names

    def _context_ring(self) -> DeferredContextKV:
        ring = self.__dict__.get("_ring")
        if ring is None:
            fc = self.model.model.fc.weight  # [hidden, num_tapped_layers * target_hidden]
            ring = self.__dict__["_ring"] = DeferredContextKV(
                DEFAULT_STEPS * self.max_num_reqs, fc.shape[1], len(self._draft_layer_names()),
                fc.dtype, self.device)
        return ring

    def context_fits(self, num_tokens: int) -> bool:
        return self._context_ring().fits(num_tokens)

    def note_context_appended(self, num_tokens: int) -> None:
        self._context_ring().note_appended(num_tokens)

    def reset_context(self) -> None:
        """Forget queued rows (graph capture and profiling append dummy ones)."""
        ring = self.__dict__.get("_ring")
        if ring is not None:
            ring.reset()

    def flush_context(self) -> bool:
        ring = self.__dict__.get("_ring")
        if ring is None or ring.pending == 0:
            return False
        names = self._draft_layer_names()

        def write(aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
            entries = {name: KVWriteOnlyMetadata(slot_mapping=slots[i])
                       for i, name in enumerate(names)}
            with set_forward_context(entries, self.vllm_config):
                self.model.precompute_context_kv(aux, positions)
        return ring.flush(write)

    def _graph_size(self, num_reqs: int) -> int | None:
        if self.cudagraphs is not None and self.draft_sample_method == "greedy":
            return self.cudagraphs.padded_num_reqs(num_reqs)
        return None

    def _propose(self, inputs: DraftInputs) -> torch.Tensor:
        num_reqs, q = inputs.num_reqs, self.query_len
        self._begin_drafts(inputs)
        early, self._early = self.__dict__.get("_early"), None
        if num_reqs == 0:
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.int64,
                               device=self.device)
        accepted_np = np.asarray(inputs.num_computed_new, dtype=np.int64)
        seq_lens_np = accepted_np[:num_reqs] + q
        np.minimum(seq_lens_np, self.max_model_len, out=seq_lens_np)
        if early is not None and early.num_reqs == num_reqs:
            # Built while the verify step ran (prepare_early): the block inputs are written and
            # the metadata planned for the upper bound; lower its host lengths to the exact ones
            # (or build it again from them where a builder cannot).
            graph_size, padded = early.graph_size, early.padded
            anchors, slot_mappings = early.anchors, early.slot_mappings
            if early.lowered_on_device:  # lowered before the wait: nothing left to do
                attn_metadata = early.attn_metadata
                self.early_device_lowerings += 1
            elif refresh_attn_metadata_seq_lens(
                    attn_metadata_builders=self.attn_metadata_builders,
                    kv_cache_config=self.kv_cache_config, attn_metadata=early.attn_metadata,
                    seq_lens_np=seq_lens_np, group_ids=self.group_ids):
                attn_metadata = early.attn_metadata
                self.early_refreshes += 1
            else:
                attn_metadata = self._block_attn_metadata(num_reqs, padded, graph_size,
                                                          early.target_seq_lens, seq_lens_np,
                                                          slot_mappings)
                self.early_rebuilds += 1
        else:
            graph_size = self._graph_size(num_reqs)
            padded = graph_size or num_reqs
            accepted = inputs.accepted_on_device(self.device)
            anchors, slot_mappings = self._write_block(num_reqs, padded, accepted,
                                                       inputs.next_token_ids)
            attn_metadata = self._block_attn_metadata(num_reqs, padded, graph_size,
                                                      inputs.target_seq_lens_cpu, seq_lens_np,
                                                      slot_mappings)
        if graph_size is not None:
            return self.cudagraphs.replay(graph_size)[0][:num_reqs]
        return self._block_step(attn_metadata, padded, anchors)[0]

    def _block_attn_metadata(self, num_reqs: int, padded: int, graph_size: int | None,
                             target_seq_lens, seq_lens_np: np.ndarray,
                             slot_mappings: torch.Tensor) -> dict:
        """The draft block's attention metadata (uniform non-causal rows of Q tokens) for host
        lengths `seq_lens_np`; the block input write has filled the device buffers."""
        q = self.query_len
        return self._build_draft_attn_metadata(
            num_reqs, padded, padded * q, target_seq_lens, step=q, num_query_per_req=q,
            causal=False, seq_lens_np=seq_lens_np, cudagraph=graph_size is not None,
            slot_mappings=slot_mappings, padding_written=True)

    # ---- the draft step's inputs and metadata, prepared while the verify step runs --------
    early_refreshes = 0  # early metadata whose lengths were lowered in place
    early_rebuilds = 0   # early metadata built again from the exact lengths
    early_device_lowerings = 0  # early metadata lowered on the device before the wait
    early_launches = 0  # of those, draft steps launched before the wait (prepare_early)
    early_reuses = 0  # of those, on the previous step's plans advanced on the device
    early_fused_lowerings = 0  # of those, lowered by the input write itself (FusedDraftLowering)
    # Lower early plans on the device (and launch the draft step before the wait): None reads
    # VLLM_EARLY_DRAFT_DEVICE_LOWERING; a bool decides for this speculator (an in-process A/B
    # of engines alive at once, scripts/probe_early_draft.py).
    device_lowering: bool | None = None

    def wants_early_draft(self) -> bool:
        """Whether prepare_early may run before the runner waits for a step's output
        (early_draft.py: VLLM_EARLY_DRAFT_METADATA). "auto" (default): with a captured greedy
        draft step and builders that can lower planned lengths in place (FlashInfer MLA at
        DCP 1), to move the draft's host work into the verify step's GPU time, and then only
        where `early_tuner` measures it faster; "0": never; "1": wherever the step allows it
        (tests run it eagerly, where it builds twice)."""
        wanted = self.__dict__.get("_wants_early")
        if wanted is None:
            mode = early_draft_mode()
            wanted = self._early_draft_for(mode)
            if self.cudagraphs is not None or mode != "auto":  # auto: decided with graphs
                self.__dict__["_wants_early"] = wanted
                self.early_tuner = EarlyDraftTuner() if wanted and mode == "auto" else None
        return wanted

    # Mode "auto": the per-engine A/B of the early path (None: no tuning, as decided).
    early_tuner: EarlyDraftTuner | None = None

    def set_early_draft_mode(self, mode: str, tune: bool = True) -> None:
        """Decide the early draft step for this speculator from `mode` (one of
        early_draft.MODES) instead of the environment (benchmarks A/B both in one process);
        `tune=False` keeps an eligible "auto" on without its measured A/B."""
        if mode not in MODES:
            raise ValueError(f"early draft mode {mode!r} is invalid: use one of {list(MODES)}")
        wanted = self.__dict__["_wants_early"] = self._early_draft_for(mode)
        self.early_tuner = EarlyDraftTuner() if wanted and mode == "auto" and tune else None

    def _early_draft_for(self, mode: str) -> bool:
        if mode == "auto":
            groups = self.group_ids or range(len(self.attn_metadata_builders))
            return bool(self.early_draft_lengths_exact() and self.cudagraphs is not None
                        and self.draft_sample_method == "greedy"
                        and all(hasattr(self.attn_metadata_builders[g], "refresh_decode_seq_lens")
                                for g in groups))
        return mode == "1" and self.early_draft_lengths_exact()

    def prepare_early(self, num_reqs: int, accepted: torch.Tensor, next_token_ids: torch.Tensor,
                      upper_num_computed_new: np.ndarray, target_seq_lens: np.ndarray,
                      lower_num_computed_new: np.ndarray | None = None, *,
                      accepted_extra: torch.Tensor | None = None, accepted_offset: int = 0,
                      next_token_rows: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
        """Write the draft block's inputs and build its attention metadata before the step's
        accepted counts reach the host. `accepted` [num_reqs] holds, on the device, the exact
        new computed counts (the runner derives them from the verify step's device output, in
        stream order); `upper_num_computed_new` [num_reqs] is their host upper bound (every
        draft accepted), from which the host planners work. _propose then lowers the planned
        lengths to the exact ones. Only where the shared base says the lowered lengths are
        the whole change (Speculator.early_draft_lengths_exact). With
        `lower_num_computed_new` (every draft rejected) and VLLM_EARLY_DRAFT_DEVICE_LOWERING=1
        the lowering is enqueued here, on the device, where the lower bound shows it valid,
        and the draft step is launched right after it: then its drafts [num_reqs, k] are
        returned (the proposal takes them through consume_early_launch), else None.
        The runner may hand the device state over as it lies, for the fused block input write
        to combine (block_inputs.py; no torch ops before it): the new computed count of row i
        is then accepted[i] + accepted_extra[i] + accepted_offset, and its anchor
        next_token_ids[next_token_rows[i]]."""
        q = self.query_len
        graph_size = self._graph_size(num_reqs)
        padded = graph_size or num_reqs
        upper = np.minimum(np.asarray(upper_num_computed_new, dtype=np.int64)[:num_reqs] + q,
                           self.max_model_len)
        target = np.array(target_seq_lens[:num_reqs], dtype=np.int64)  # kept past this step
        lowering = self.device_lowering
        if lowering is None:
            lowering = device_lowering_enabled()
        launchable = self.draft_sample_method == "greedy" and not self.defers_context
        attn_metadata, lower, lowered, held = None, None, False, None
        if lower_num_computed_new is not None and lowering:
            lower = np.minimum(np.asarray(lower_num_computed_new, dtype=np.int64)[:num_reqs] + q,
                               self.max_model_len)
            held = self.__dict__.get("_held_lowered")
            if not (launchable and held is not None and held[0] == (
                    num_reqs, padded, graph_size, self.draft_metadata_builds)):
                held = None
        # The previous lowered step's plans may still hold this step's rows, pages and chunk
        # counts: then the lengths, written from the device, are the whole change and the host
        # build of the draft metadata is skipped. Fused (fuses_plan_lowering): the plans are
        # asked before the input write, which then writes their lengths itself (one launch
        # less a step).
        fuse = None
        if held is not None and self.fuses_plan_lowering():
            fuse = FusedDraftLowering(self.input_buffers.seq_lens, num_reqs)
            lowered = self._advance_held(held, lower, upper, fuse)
        anchors, slot_mappings = self._write_block(
            num_reqs, padded, accepted, next_token_ids, accepted_offset, accepted_extra,
            next_token_rows, lowering=fuse.lowering() if lowered else None)
        if fuse is not None:
            self.early_fused_lowerings += bool(lowered and fuse.lowerings)
            fuse.finish(written=lowered)
        elif held is not None:
            lowered = self._advance_held(held, lower, upper)
        if lowered:
            attn_metadata = held[1]
            self.early_reuses += 1
        if attn_metadata is None:
            attn_metadata = self._block_attn_metadata(num_reqs, padded, graph_size, target,
                                                      upper, slot_mappings)
            if lower is not None:
                lowered = lower_attn_metadata_on_device(
                    attn_metadata_builders=self.attn_metadata_builders,
                    kv_cache_config=self.kv_cache_config, attn_metadata=attn_metadata,
                    lower_seq_lens_np=lower, group_ids=self.group_ids)
        # Plans lowered on the device may carry the next step (advance above) while no other
        # draft metadata was built in between (its builders and the shared query starts and
        # twins are then as this step leaves them); anything else builds anew.
        self._held_lowered = (
            (num_reqs, padded, graph_size, self.draft_metadata_builds), attn_metadata) if (
            lowered and launchable) else None
        drafts = None
        if lowered and launchable:
            # Lowered on the device, the draft step needs nothing more from the host: launch
            # it now, behind the verify step in stream order. After the wait the host then
            # only does the step's bookkeeping, and this step's draft host work (the replay)
            # runs while the host would otherwise wait for the verify step. Not with deferred
            # context KV (the runner flushes the queued rows just before the draft pass) nor
            # with probabilistic drafts (their sampling metadata comes with the proposal).
            # The drafts are the same: the same device inputs, exact lengths on the device.
            if graph_size is not None:
                drafts = self.cudagraphs.replay(graph_size)[0][:num_reqs]
            else:
                drafts = self._block_step(attn_metadata, padded, anchors)[0]
        self._early = EarlyDraft(num_reqs=num_reqs, padded=padded, graph_size=graph_size,
                                 attn_metadata=attn_metadata, anchors=anchors,
                                 slot_mappings=slot_mappings, target_seq_lens=target,
                                 lowered_on_device=lowered, drafts=drafts)
        return drafts

    def _advance_held(self, held: tuple, lower: np.ndarray, upper: np.ndarray,
                      fuse: FusedDraftLowering | None = None) -> bool:
        """advance_attn_metadata_on_device of the held lowered plans (prepare_early)."""
        return advance_attn_metadata_on_device(
            attn_metadata_builders=self.attn_metadata_builders,
            kv_cache_config=self.kv_cache_config, attn_metadata=held[1],
            lower_seq_lens_np=lower, upper_seq_lens_np=upper, group_ids=self.group_ids,
            fuse=fuse)

    # Whether prepare_early's plan advance is fused into the input write (None: read
    # VLLM_FUSED_DRAFT_PLAN_LOWERING once, at the first early step).
    fused_plan_lowering: bool | None = None

    def fuses_plan_lowering(self) -> bool:
        """VLLM_FUSED_DRAFT_PLAN_LOWERING=1: the early draft step asks its held plans to
        advance before its input write, which writes their lengths into the plan in the same
        launch (plan_lowering.FusedDraftLowering); 0 (default): the write, then the advance's
        own lowering launch. Off because it does not pay (thirtieth session, one H100, GPU tests
        passed): the draft advance's host time halves (0.083 -> 0.042 ms; the write grows by
        ~0.01), but that work runs before the runner waits for the verify step, while the GPU
        is still busy with it, so the B=1 DSpark step is no shorter (tok/s over no drafts
        1.485 on, 1.492 off)."""
        fused = self.fused_plan_lowering
        if fused is None:
            fused = self.fused_plan_lowering = switch_flag(
                FUSED_LOWERING_FLAG, False, "the input write lowers the held draft plans",
                "a lowering launch of its own after the write")
        return fused

    def consume_early_launch(self) -> torch.Tensor | None:
        early = self.__dict__.get("_early")
        if early is None or early.drafts is None:
            return None
        self._early = None
        self.early_device_lowerings += 1
        self.early_launches += 1
        return early.drafts

    def _write_block(self, num_reqs: int, padded: int, accepted: torch.Tensor,
                     next_token_ids: torch.Tensor, accepted_offset: int = 0,
                     accepted_extra: torch.Tensor | None = None,
                     next_token_rows: torch.Tensor | None = None,
                     lowering: PlanLowering | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block inputs for `padded` rows (rows past num_reqs are CUDA-graph padding: position
        0, no KV, length 0): ids = anchor + masks at positions accepted + arange(Q), the draft
        seq_lens and the drafter groups' slot mappings, in one fused write (block_inputs.py;
        the optional terms as prepare_early says). Returns (anchors [padded], slot mappings
        [num_groups, padded * Q])."""
        q = self.query_len
        # Columns 1.. hold the mask token in every row, always: written once (the buffer is the
        # speculator's own; only column 0, the anchor, changes between steps).
        if self._masks_written < padded:
            block_ids = self.input_buffers.input_ids[: padded * q].view(padded, q)
            block_ids[:, 1:].fill_(int(self.model.config.mask_token_id))
            self._masks_written = padded
        slot_mappings = self._write_uniform_rows(num_reqs, padded, q, accepted, next_token_ids,
                                                 accepted_offset, accepted_extra,
                                                 next_token_rows, lowering)
        return self._anchor_views(padded), slot_mappings

    def _anchor_views(self, padded: int) -> torch.Tensor:
        """anchors[:padded] of the persistent anchor buffer (the fused write fills it), one view
        per size (a torch slice costs the host ~1.5 us)."""
        views = self.__dict__.setdefault("_anchor_view_cache", {})
        view = views.get(padded)
        if view is None:
            view = views[padded] = self._uniform_buffers(self.query_len).anchors[:padded]
        return view

    def _block_step(self, attn_metadata, padded: int, anchors: torch.Tensor) -> tuple:
        """The captured part of a draft step: block forward, LM head, draft choice."""
        q = self.query_len
        num_tokens = padded * q
        buffers = self.input_buffers
        hidden = self._run_forward(attn_metadata, self.model, buffers.input_ids[:num_tokens],
                                   buffers.positions[:num_tokens])
        logits = self.model.compute_logits(hidden).view(padded, q, -1)
        return (self.select_drafts(logits, anchors),)

    def capture_graphs(self, manager) -> None:
        """Capture the greedy draft step for every capture size (block drafters only)."""
        q = self.query_len
        self.cudagraphs = None  # eager while preparing the dummy steps

        def prepare(size: int):
            accepted = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.block_tables.gather_block_tables(
                torch.zeros(size, dtype=torch.int64, device=self.device), np.zeros(size, np.int64))
            anchors, slot_mappings = self._write_block(size, size, accepted, accepted)
            md = self._build_draft_attn_metadata(
                size, size, size * q, np.full(size, q), step=q, num_query_per_req=q,
                causal=False, seq_lens_np=np.full(size, q), cudagraph=True,
                slot_mappings=slot_mappings, padding_written=True)
            return md, size, anchors

        manager.capture_all(prepare, lambda batch: self._block_step(*batch))
        self.cudagraphs = manager
