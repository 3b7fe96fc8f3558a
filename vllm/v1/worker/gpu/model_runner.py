"""GPUModelRunner: one rank's view of an engine step (any device; the name follows upstream).

Per step: drop finished/preempted requests, admit new ones into persistent slots, lay out the
batch (decode rows first, prefills after), build attention metadata per KV cache group (target
DCP-local lengths via prepare_dcp_local_seq_lens), run the target (KV written before attention),
verify drafts with the rejection sampler, then let the speculator propose the next drafts.

Every rank runs the same step on the same scheduler output and samples identically (per-request
generators seeded the same everywhere), so each rank's request state stays in lock-step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.core.kv_cache_utils import num_virtual_blocks
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import RequestGenerators, SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.request_states import RequestStates
from vllm.v1.worker.gpu.spec_decode import get_speculator_cls
from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs


def _attention_modules(model: Any) -> list[Any]:
    """The attention layers of a model (modules with a KV cache spec and a layer name)."""
    return [m for m in model.modules()
            if hasattr(m, "get_kv_cache_spec") and hasattr(m, "layer_name")]


@dataclass
class StepBatch:
    """Host-side description of one step's batch (device data lives in the input buffers)."""

    req_ids: list[str]                    # batch rows: decode rows first, prefills after
    num_tokens: int
    query_start_loc_np: np.ndarray        # [num_reqs + 1]
    num_computed: np.ndarray              # [num_reqs] tokens already in the cache
    num_scheduled: np.ndarray             # [num_reqs] tokens processed this step
    seq_lens_cpu: torch.Tensor            # [num_reqs] int32 = num_computed + num_scheduled
    drafts: list[list[int]]               # drafts verified per row (empty for prefills)
    logits_indices: torch.Tensor          # token rows whose logits are sampled / verified
    attn_metadata: dict[str, Any]         # layer name -> metadata
    # Rows that sample this step (decodes, and prefills whose last chunk this is); a row whose
    # chunked prefill is unfinished samples nothing and is absent here.
    sample_rows: list[int]
    next_prompt_tokens: dict[int, int]    # unfinished prefill row -> its next prompt token

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class GPUModelRunner:

    def __init__(self, vllm_config: Any, device: torch.device | str, rank: int = 0):
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.rank = rank
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.max_model_len = int(model_config.max_model_len)
        self.kv_dtype = model_config.torch_dtype
        self.block_size = int(vllm_config.cache_config.block_size)
        self.dcp_size = int(parallel.decode_context_parallel_size)
        self.dcp_interleave = int(parallel.cp_kv_cache_interleave_size)
        self.dcp_rank = 0
        if self.dcp_size > 1:
            from vllm.distributed.parallel_state import get_dcp_group
            self.dcp_rank = get_dcp_group().rank_in_group

        self.spec_config = vllm_config.speculative_config
        self.num_spec_tokens = (int(self.spec_config.num_speculative_tokens)
                                if self.spec_config is not None else 0)
        self.max_num_reqs = int(vllm_config.max_num_seqs)
        # A draft block carries up to k+1 tokens per request, which may exceed the target budget.
        self.max_num_tokens = max(int(vllm_config.max_num_batched_tokens),
                                  self.max_num_reqs * (self.num_spec_tokens + 1))

        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, self.device)
        self.requests = RequestStates(self.max_num_reqs)
        self.generators = RequestGenerators(self.device, int(getattr(model_config, "seed", 0)))
        self.sampler = Sampler()
        self.rejection_sampler = (RejectionSampler(self.spec_config.rejection_sample_method)
                                  if self.spec_config is not None else None)

        self.model: Any = None
        self.draft_model: Any = None
        self.speculator: Any = None
        self.kv_cache_config: Any = None
        self.block_tables: BlockTables | None = None
        self.attn_metadata_builders: list[Any] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Probabilistic drafting: q [k, V] of each request's pending drafts, for verification.
        self.pending_draft_probs: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        from vllm.model_executor.model_loader import get_draft_model, get_model
        self.model = get_model(self.vllm_config)
        if self.spec_config is not None:
            self.draft_model = get_draft_model(self.vllm_config, self.model)

    def _attention_layers(self) -> dict[str, Any]:
        """layer_name -> attention module, target layers first, then the drafter's."""
        layers: dict[str, Any] = {}
        for model in (self.model, self.draft_model):
            if model is None:
                continue
            for module in _attention_modules(model):
                if module.layer_name in layers:
                    raise ValueError(f"two attention layers are named {module.layer_name!r}; "
                                     "the drafter's layers need their own prefix")
                layers[module.layer_name] = module
        return layers

    def _draft_layer_names(self) -> set[str]:
        if self.draft_model is None:
            return set()
        return {m.layer_name for m in _attention_modules(self.draft_model)}

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Spec of every attention layer (target + drafter), keyed by layer name."""
        if self.model is None:
            raise RuntimeError("call load_model() before get_kv_cache_spec()")
        return {name: layer.get_kv_cache_spec(self.block_size, self.kv_dtype)
                for name, layer in self._attention_layers().items()}

    def initialize_kv_cache(self, kv_cache_config: Any) -> None:
        """Allocate one [num_blocks, block_size, 576] tensor per layer, block tables and one
        metadata builder per KV cache group, and the speculator bound to its own groups."""
        from vllm.v1.attention.backends.mla.common import validate_dspark_dcp_backends
        from vllm.v1.attention.selector import get_attn_backend

        self.kv_cache_config = kv_cache_config
        layers = self._attention_layers()
        groups = kv_cache_config.kv_cache_groups
        grouped = [name for g in groups for name in g.layer_names]
        missing = sorted(set(layers) - set(grouped))
        if missing:
            raise ValueError(f"KV cache config has no group for layers {missing}; build it from "
                             "get_kv_cache_spec()")
        for group in groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                cache = torch.zeros(kv_cache_config.num_blocks, spec.block_size, spec.head_size,
                                    dtype=spec.dtype, device=self.device)
                layers[name].kv_cache = cache
                self.kv_caches[name] = cache

        # The scheduler may allocate k+1 tokens of headroom past the last verified position.
        max_blocks = num_virtual_blocks(self.max_model_len + 2 * (self.num_spec_tokens + 1),
                                        self.block_size, self.dcp_size)
        self.block_tables = BlockTables(
            [g.kv_cache_spec.block_size for g in groups], self.max_num_reqs, max_blocks,
            self.max_num_tokens, self.device, cp_size=self.dcp_size, cp_rank=self.dcp_rank,
            cp_interleave=self.dcp_interleave)

        backend = get_attn_backend(self.vllm_config.model_config.attention_backend, self.device)
        builder_cls = backend.get_builder_cls()
        self.attn_metadata_builders = [
            builder_cls(g.kv_cache_spec, g.layer_names, self.vllm_config, self.device)
            for g in groups]
        for builder in self.attn_metadata_builders:
            # Verification rows (1 + k tokens) are decode rows; longer rows (prefill chunks,
            # with or without cached context) take the prefill path.
            builder.reorder_batch_threshold = 1 + self.num_spec_tokens
        validate_dspark_dcp_backends(
            self.spec_config.method if self.spec_config is not None else None, self.dcp_size,
            [(g.kv_cache_spec, builder_cls) for g in groups])

        if self.spec_config is not None:
            speculator_cls = get_speculator_cls(self.spec_config.method)
            self.speculator = speculator_cls(self.vllm_config, self.device, self.block_tables,
                                             self.max_num_reqs, self.max_num_tokens)
            self.speculator.model = self.draft_model
            draft_layers = self._draft_layer_names()
            group_ids = tuple(i for i, g in enumerate(groups)
                              if draft_layers.intersection(g.layer_names))
            self.speculator.bind_attention(kv_cache_config, self.attn_metadata_builders, group_ids)

    # ------------------------------------------------------------ state update
    def _update_states(self, scheduler_output: Any) -> None:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        for req_id in set(scheduler_output.finished_req_ids) | set(
                scheduler_output.preempted_req_ids):
            state = self.requests.remove(req_id)
            self.pending_draft_probs.pop(req_id, None)
            if state is not None:
                self.block_tables.remove_request(state.slot)
            if req_id in scheduler_output.finished_req_ids:
                self.generators.remove_request(req_id)

        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.requests:  # re-admitted after a preemption we did not see
                self.block_tables.remove_request(self.requests.remove(new.req_id).slot)
            state = self.requests.add(new.req_id, new.prompt_token_ids, new.num_computed_tokens,
                                      new.sampling_params)
            self.block_tables.append_block_ids(state.slot, (list(new.block_ids),) * num_groups,
                                               overwrite=True)
            # Idempotent per request id: a preempted request keeps its generator and its draws.
            self.generators.add_request(new.req_id, new.sampling_params)

        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests[req_id]
            if int(num_computed) != state.num_computed_tokens:
                # Both sides advance the count the same way (rejected drafts and unfinished
                # prefill chunks included); a mismatch means the two views diverged.
                raise ValueError(
                    f"request {req_id!r}: scheduler says {int(num_computed)} computed tokens but "
                    f"the runner has computed {state.num_computed_tokens}; the scheduler must "
                    "advance num_computed_tokens by what the runner reported")
            if new_block_ids:
                self.block_tables.append_block_ids(state.slot, (list(new_block_ids),) * num_groups,
                                                   overwrite=False)

    # ------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        if self.kv_cache_config is None:
            raise RuntimeError("call initialize_kv_cache() before execute_model()")
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[],
                                     spec_token_ids=[] if self.speculator else None)
        batch = self._prepare_inputs(scheduler_output)
        num_reqs, num_tokens = batch.num_reqs, batch.num_tokens
        buffers = self.input_buffers
        input_ids = buffers.input_ids[:num_tokens]
        positions = buffers.positions[:num_tokens]

        aux_layers = self.speculator.aux_hidden_state_layers if self.speculator else ()
        aux_hidden = None
        with set_forward_context(batch.attn_metadata, self.vllm_config):
            if aux_layers:
                hidden, aux_list = self.model(input_ids, positions,
                                              aux_hidden_state_layers=aux_layers)
                aux_hidden = torch.cat(list(aux_list), dim=-1)
            else:
                hidden = self.model(input_ids, positions)
            if self.speculator is not None:
                # Block drafters store context KV of the processed tokens through the draft
                # group's slot mapping of this very step.
                self.speculator.precompute_context(aux_hidden, positions)

        req_ids = batch.req_ids
        # Only rows that finish their prefill (or decode) sample; the others get [] (chunked
        # prefill: the scheduler just advances their computed count).
        rows = batch.sample_rows
        sample_ids = [req_ids[i] for i in rows]
        sampled: list[list[int]] = [[] for _ in range(num_reqs)]
        num_draft, num_accepted = [0] * num_reqs, [0] * num_reqs
        sampling_metadata = None
        if rows:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            params = [self.requests[r].sampling_params for r in sample_ids]
            sampling_metadata = SamplingMetadata.from_sampling_params(
                params, self.device, self.generators.for_batch(sample_ids))
            drafts = [batch.drafts[i] for i in rows]
            if self.rejection_sampler is not None:
                result = self.rejection_sampler(logits, drafts, sampling_metadata,
                                                self._draft_probs_for(sample_ids, drafts, logits))
                row_sampled, row_draft, row_accepted = (
                    result.sampled_token_ids, result.num_draft_tokens, result.num_accepted_tokens)
            else:
                row_sampled = [[t] for t in self.sampler(logits, sampling_metadata).tolist()]
                row_draft = row_accepted = [0] * len(rows)
            for j, i in enumerate(rows):
                sampled[i] = list(row_sampled[j])
                num_draft[i], num_accepted[i] = int(row_draft[j]), int(row_accepted[j])

        num_computed_old = batch.num_computed
        num_scheduled = batch.num_scheduled
        num_rejected = np.asarray(num_draft, dtype=np.int64) - np.asarray(num_accepted, np.int64)
        num_computed_new = num_computed_old + num_scheduled - num_rejected
        for req_id, tokens, computed in zip(req_ids, sampled, num_computed_new):
            state = self.requests[req_id]
            state.token_ids.extend(tokens)
            state.num_computed_tokens = int(computed)

        spec_token_ids = None
        if self.speculator is not None:
            qsl = batch.query_start_loc_np
            last_accepted = qsl[:num_reqs] + (num_computed_new - num_computed_old) - 1
            # An unfinished prefill row still runs through the drafter (EAGLE/MTP write their
            # draft KV for the chunk's positions, anchored on the next prompt token); its
            # drafts are discarded below and the next chunk overwrites what they wrote.
            anchors = [t[-1] if t else batch.next_prompt_tokens[i] for i, t in enumerate(sampled)]
            if len(rows) == num_reqs:
                draft_sampling = sampling_metadata
            else:
                # Unfinished rows draft greedily: they must not draw from their generators.
                sampling = set(rows)
                draft_sampling = SamplingMetadata.from_sampling_params(
                    [self.requests[r].sampling_params if i in sampling else None
                     for i, r in enumerate(req_ids)], self.device,
                    {i: g for i, g in self.generators.for_batch(req_ids).items()
                     if i in sampling})
            draft_inputs = DraftInputs(
                num_reqs=num_reqs,
                query_start_loc_np=qsl,
                target_input_ids=input_ids,
                target_positions=positions,
                target_hidden_states=hidden,
                target_seq_lens_cpu=batch.seq_lens_cpu,
                num_computed_new=num_computed_new,
                last_accepted_index=torch.as_tensor(last_accepted, dtype=torch.int64,
                                                    device=self.device),
                next_token_ids=torch.tensor(anchors, dtype=torch.int64, device=self.device),
                aux_hidden_states=aux_hidden,
                sampling_metadata=draft_sampling,
            )
            spec_token_ids = self.speculator.propose(draft_inputs).tolist()
            probs = self.speculator.draft_probs
            for i, req_id in enumerate(req_ids):
                if not sampled[i]:  # prefill unfinished: no drafts until it completes
                    spec_token_ids[i] = []
                    self.pending_draft_probs.pop(req_id, None)
                elif probs is None:
                    self.pending_draft_probs.pop(req_id, None)
                else:
                    self.pending_draft_probs[req_id] = probs[i]

        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled,
                                 spec_token_ids=spec_token_ids, num_draft_tokens=list(num_draft),
                                 num_accepted_tokens=list(num_accepted))

    def _draft_probs_for(self, req_ids: list[str], drafts: list[list[int]],
                         logits: torch.Tensor) -> torch.Tensor | None:
        """q of the drafts verified this step ([total drafts, V]), or None for greedy drafting
        (the rejection sampler then treats q as one-hot on each draft)."""
        if self.speculator is None or self.speculator.draft_sample_method == "greedy":
            return None
        rows = []
        for req_id, req_drafts in zip(req_ids, drafts):
            if not req_drafts:
                continue
            probs = self.pending_draft_probs.get(req_id)
            if probs is None:  # drafts not sampled here: q is one-hot on them
                probs = torch.nn.functional.one_hot(
                    torch.tensor(req_drafts, device=self.device), logits.shape[-1]).float()
            rows.append(probs[: len(req_drafts)])
        if not rows:
            return None
        return torch.cat(rows).to(self.device)

    def _prepare_inputs(self, scheduler_output: Any) -> StepBatch:
        """Write this step's batch into the persistent buffers and build its metadata."""
        # Decode rows (query <= 1 + k tokens, the builders' reorder_batch_threshold) first,
        # prefill rows (chunks with or without cached context) after: the MLA builder's split.
        threshold = 1 + self.num_spec_tokens
        decode_ids, prefill_ids = [], []
        new_set = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        for r, count in scheduler_output.num_scheduled_tokens.items():
            is_decode = (int(count) <= threshold and r not in new_set
                         and self.requests[r].num_computed_tokens > 0)
            (decode_ids if is_decode else prefill_ids).append(r)
        req_ids = decode_ids + prefill_ids
        num_reqs = len(req_ids)

        buffers = self.input_buffers
        qsl_np = buffers.query_start_loc_np
        qsl_np[0] = 0
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        drafts: list[list[int]] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        next_prompt_tokens: dict[int, int] = {}
        num_computed = np.zeros(num_reqs, dtype=np.int64)
        num_scheduled = np.zeros(num_reqs, dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            count = int(scheduler_output.num_scheduled_tokens[req_id])
            start = state.num_computed_tokens
            req_drafts = list(scheduler_output.scheduled_spec_decode_tokens.get(req_id, []))
            # Known tokens processed this step: [start, end); drafts follow the last one.
            end = start + count - len(req_drafts)
            known = len(state.token_ids)
            if end > known or end <= start:
                raise ValueError(
                    f"request {req_id!r}: {count} tokens scheduled ({len(req_drafts)} drafts) "
                    f"from {start} computed tokens, but the runner holds {known} tokens; "
                    "num_scheduled_tokens must be 1..(known - computed) tokens (a decode: "
                    "1 + len(drafts))")
            if req_drafts and end != known:
                raise ValueError(
                    f"request {req_id!r}: drafts scheduled while its prefill is unfinished "
                    f"({end} of {known} tokens); drafts follow only the last known token")
            tokens = state.token_ids[start:end] + req_drafts
            if start + count > self.max_model_len:
                raise ValueError(f"request {req_id!r} would reach {start + count} tokens, past "
                                 f"max_model_len={self.max_model_len}")
            token_ids.extend(tokens)
            positions.append(np.arange(start, start + count, dtype=np.int64))
            qsl_np[i + 1] = qsl_np[i] + count
            if end == known:
                # Decode rows verify every position; a prefill samples from its last one only.
                first_logit = int(qsl_np[i]) if req_drafts else int(qsl_np[i + 1]) - 1
                logits_indices.extend(range(first_logit, int(qsl_np[i + 1])))
                sample_rows.append(i)
            else:
                next_prompt_tokens[i] = state.token_ids[end]
            drafts.append(req_drafts)
            num_computed[i] = start
            num_scheduled[i] = count

        num_tokens = int(qsl_np[num_reqs])
        if num_tokens > self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens scheduled, more than the runner's buffers hold "
                             f"({self.max_num_tokens}); raise max_num_batched_tokens")
        buffers.input_ids[:num_tokens].copy_(torch.tensor(token_ids, dtype=torch.int64))
        buffers.positions[:num_tokens].copy_(torch.from_numpy(np.concatenate(positions)))
        buffers.query_start_loc[: num_reqs + 1].copy_(buffers.query_start_loc_cpu[: num_reqs + 1])
        seq_lens_cpu = torch.from_numpy((num_computed + num_scheduled).astype(np.int32))
        buffers.seq_lens[:num_reqs].copy_(seq_lens_cpu)
        buffers.seq_lens[num_reqs:].zero_()

        idx_mapping = torch.tensor([self.requests[r].slot for r in req_ids], dtype=torch.int64)
        block_tables = self.block_tables.gather_block_tables(idx_mapping)
        slot_mappings = self.block_tables.compute_slot_mappings(
            buffers.query_start_loc[: num_reqs + 1], buffers.positions[:num_tokens])
        dcp_local_seq_lens = None
        if self.dcp_size > 1:
            prepare_dcp_local_seq_lens(buffers.dcp_local_seq_lens, buffers.seq_lens, num_reqs,
                                       self.dcp_size, self.dcp_rank, self.dcp_interleave)
            dcp_local_seq_lens = buffers.dcp_local_seq_lens[:num_reqs]
        num_computed_cpu = torch.from_numpy(num_computed.astype(np.int32))
        attn_metadata = build_attn_metadata(
            attn_metadata_builders=self.attn_metadata_builders,
            kv_cache_config=self.kv_cache_config,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc=buffers.query_start_loc,
            query_start_loc_cpu=buffers.query_start_loc_cpu,
            seq_lens=buffers.seq_lens,
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens_cpu.max()),
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            causal=True,
            dcp_local_seq_lens=dcp_local_seq_lens,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=num_computed_cpu,
        )
        return StepBatch(
            req_ids=req_ids, num_tokens=num_tokens,
            query_start_loc_np=qsl_np[: num_reqs + 1].copy(), num_computed=num_computed,
            num_scheduled=num_scheduled, seq_lens_cpu=seq_lens_cpu, drafts=drafts,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            attn_metadata=attn_metadata, sample_rows=sample_rows,
            next_prompt_tokens=next_prompt_tokens)
