"""GPUModelRunner: one rank's view of an engine step (any device; the name follows upstream).

Per step: drop finished/preempted requests, admit new ones into persistent slots, build the step's
InputBatch once (decode rows first, prefills after; inputs prepared on the device from the
slot-indexed request state), build attention metadata per KV cache group from it, run the target
(KV written before attention; uniform decode batches replay a captured CUDA graph), verify drafts
on the device, copy the sampled tokens to the host ONCE (pinned, event-synchronised: the step's
only device->host transfer), then let the speculator propose the next drafts, which stay on the
device in the slot-indexed draft buffer (the scheduler only sees placeholders).

Every rank runs the same step on the same scheduler output and samples identically (per-request
generators seeded the same everywhere), so each rank's request state stays in lock-step.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.utils.cuda_streams import record_event
from vllm.v1.attention.backends.mla.plan_lowering import PlanLowering
from vllm.v1.core.kv_cache_utils import num_virtual_blocks
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.metadata import RequestGenerators, SamplingMetadata, is_greedy
from vllm.v1.sample.ops.greedy_verify import (HAS_TRITON, greedy_verify_torch,
                                              greedy_verify_triton)
from vllm.v1.sample.rejection_sampler import RejectionSampler, verification_layout
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu.async_utils import (AsyncModelRunnerOutput, LaunchedStep,
                                             StepOutputBuffers)
from vllm.v1.worker.gpu.attn_utils import (KVWriteOnlyMetadata, advance_graph_metadata,
                                            build_attn_metadata, graph_step_advance_enabled)
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.buffer_utils import CpuGpuBuffer
from vllm.v1.worker.gpu.graph_sampling import captured_greedy_step
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBatchBuilder
from vllm.v1.worker.gpu.request_states import RequestState, RequestStates
from vllm.v1.worker.gpu.sample_utils import (BatchRows, SamplingStates,
                                             sampling_row_index)
from vllm.v1.worker.gpu.spec_decode import get_speculator_cls
from vllm.v1.worker.gpu.spec_decode.context_refill import (ENV_FLAG as REFILL_FLAG,
                                                          ContextRefillTracker, RefillPiece,
                                                          chunk_pieces, refill_enabled)
from vllm.v1.worker.gpu.spec_decode.speculator import DraftInputs
from vllm.v1.worker.gpu.spec_decode.step_output import apply_verified_step

logger = logging.getLogger(__name__)


def _attention_modules(model: Any) -> list[Any]:
    """The attention layers of a model (modules with a KV cache spec and a layer name)."""
    return [m for m in model.modules()
            if hasattr(m, "get_kv_cache_spec") and hasattr(m, "layer_name")]


class GPUModelRunner:

    # (tuner, rows, early) of a synchronous step whose early draft path is being A/B-timed
    # (early_draft.EarlyDraftTuner), set by _prepare_draft_early, read once the step finished.
    _early_timing = None

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

        self.batch_builder = InputBatchBuilder(
            self.max_num_reqs, self.max_num_tokens, self.device, self.num_spec_tokens,
            self.dcp_size, self.dcp_rank, self.dcp_interleave)
        self.input_buffers = self.batch_builder.buffers
        self.requests = RequestStates(self.max_num_reqs, self.device, self.num_spec_tokens)
        # The step's one device->host transfer: [rows, k + 2] = sampled tokens (-1 padded) and
        # the number sampled, packed on the device (`_step_buffers.gpu`, which the captured
        # greedy step writes) and copied into one of two pinned buffers, completed by an event.
        self._step_buffers = StepOutputBuffers(self.max_num_reqs, self.num_spec_tokens + 2,
                                               self.device)
        # Async scheduling (execute_model_async): the launched step not collected yet, and the
        # events after its input copies (and after its sampling copies, when it made any) that
        # the next launch waits on before it rewrites pinned staging (_retire_previous_step).
        self._inflight: AsyncModelRunnerOutput | None = None
        self._inputs_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._sample_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._wait_inputs = self._wait_sample = False
        # Per-slot sampling settings (filled when a request is admitted; pinned twins).
        self._temperature = CpuGpuBuffer(self.max_num_reqs, dtype=torch.float32, device=self.device)
        self._top_k = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64, device=self.device)
        self._top_p = CpuGpuBuffer(self.max_num_reqs, dtype=torch.float32, device=self.device,
                                   fill=1.0)
        self._zero_temperature = torch.zeros(self.max_num_reqs, dtype=torch.float32,
                                             device=self.device)
        # is_greedy(params) per slot (set on admission): the per-step all-greedy test is one
        # numpy gather instead of a Python call per request.
        self._greedy_np = np.ones(self.max_num_reqs, dtype=bool)
        # num_sampled of a step that verifies no drafts: one token per row (read-only)
        self._ones = torch.ones(self.max_num_reqs, dtype=torch.int64, device=self.device)
        # Sampling row j is batch row j when every row samples (read-only; no per-step copy).
        self._row_arange = torch.arange(self.max_num_reqs, dtype=torch.int64, device=self.device)
        self._greedy_verify = (greedy_verify_triton if self.device.type == "cuda" and HAS_TRITON
                               else greedy_verify_torch)
        self._forced = CpuGpuBuffer(self.max_num_reqs, max(self.num_spec_tokens, 1),
                                    dtype=torch.int64, device=self.device)
        self._num_computed_new = CpuGpuBuffer(self.max_num_reqs, dtype=torch.int64,
                                              device=self.device)
        self._last_drafts: tuple[list[str], torch.Tensor] | None = None
        # Penalties, logits processors and logprobs (sample_utils.py); sized once the model is known.
        self.sampling_states: SamplingStates | None = None
        # CUDA graphs of uniform decode/verify steps (never on CPU, never with enforce_eager).
        self.cudagraphs = None
        if (self.device.type == "cuda" and not getattr(model_config, "enforce_eager", False)):
            from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
            sizes = vllm_config.compilation_config.resolve(self.max_num_reqs)
            self.cudagraphs = CudaGraphManager(sizes, 1 + self.num_spec_tokens, self.device)
        # One manager per captured query length. A speculation policy may schedule plain Q = 1
        # decodes in a speculative engine (disable_by_batch_size): those get graphs of their own.
        self._graph_managers: dict[int, Any] = {}
        if self.cudagraphs is not None:
            self._graph_managers[self.cudagraphs.query_len] = self.cudagraphs
            policy = getattr(self.spec_config, "disable_by_batch_size", None)
            if self.num_spec_tokens > 0 and policy is not None:
                self._graph_managers[1] = CudaGraphManager(sizes, 1, self.device)
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
        # Probabilistic drafting: the speculator's slot-indexed q buffer of the pending drafts,
        # and which slots it holds q for (forced drafts: one-hot q).
        self._draft_probs: torch.Tensor | None = None
        self._has_draft_probs = np.zeros(self.max_num_reqs, dtype=bool)

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        from vllm.model_executor.model_loader import get_draft_model, get_model
        self.model = get_model(self.vllm_config)
        vocab_size = int(self.vllm_config.model_config.hf_config.vocab_size)
        self.sampling_states = SamplingStates(self.max_num_reqs, vocab_size, self.device)
        if self.spec_config is not None:
            self.draft_model = get_draft_model(self.vllm_config, self.model)
            from vllm.v1.worker.gpu.spec_decode.draft_parallel import (draft_kv_replicated,
                                                                       mark_dcp_replicated)
            if draft_kv_replicated(self.vllm_config):  # non-DCP drafter under a DCP target
                mark_dcp_replicated(self.draft_model)

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
        sharded = [bool(getattr(g.kv_cache_spec, "dcp_sharded", True)) for g in groups]
        if not all(sharded) and getattr(kv_cache_config, "dcp_size", 1) != self.dcp_size:
            raise ValueError(f"KV cache config was sized for dcp_size={kv_cache_config.dcp_size} "
                             f"but this rank runs DCP {self.dcp_size} with a replicated group; "
                             f"build it with get_kv_cache_config(..., dcp_size={self.dcp_size})")
        for group in groups:
            spec = group.kv_cache_spec
            # A replicated (non-DCP drafter) group keeps dcp_size pages per block id.
            pages = kv_cache_config.num_blocks * spec.pages_per_block_id(self.dcp_size)
            for name in group.layer_names:
                cache = torch.zeros(pages, spec.block_size, spec.head_size,
                                    dtype=spec.dtype, device=self.device)
                layers[name].kv_cache = cache
                self.kv_caches[name] = cache

        # The scheduler may allocate k+1 tokens of headroom past the last verified position.
        max_blocks = num_virtual_blocks(self.max_model_len + 2 * (self.num_spec_tokens + 1),
                                        self.block_size, self.dcp_size)
        self.block_tables = BlockTables(
            [g.kv_cache_spec.block_size for g in groups], self.max_num_reqs, max_blocks,
            self.max_num_tokens, self.device, cp_size=self.dcp_size, cp_rank=self.dcp_rank,
            cp_interleave=self.dcp_interleave, dcp_sharded=sharded)

        # One backend per KV cache group, resolved once: the group's builder makes the metadata
        # and every layer of the group runs that backend's impl (no per-layer fallback).
        self.attn_backends = [get_attn_backend(self.vllm_config.model_config.attention_backend,
                                               self.device) for _ in groups]
        self.attn_metadata_builders = [
            backend.get_builder_cls()(g.kv_cache_spec, g.layer_names, self.vllm_config, self.device)
            for backend, g in zip(self.attn_backends, groups)]
        for backend, g in zip(self.attn_backends, groups):
            for name in g.layer_names:
                layers[name].bind_attention_backend(backend)
        validate_dspark_dcp_backends(
            self.spec_config.method if self.spec_config is not None else None, self.dcp_size,
            [(g.kv_cache_spec, type(b)) for g, b in zip(groups, self.attn_metadata_builders)])

        if self.spec_config is not None:
            speculator_cls = get_speculator_cls(self.spec_config.method)
            self.speculator = speculator_cls(self.vllm_config, self.device, self.block_tables,
                                             self.max_num_reqs, self.max_num_tokens)
            self.speculator.model = self.draft_model
            draft_layers = self._draft_layer_names()
            group_ids = tuple(i for i, g in enumerate(groups)
                              if draft_layers.intersection(g.layer_names))
            self.speculator.bind_attention(kv_cache_config, self.attn_metadata_builders, group_ids)
        # The target step plans attention only for groups with target layers; a group holding
        # only drafter layers gets its slot mapping alone there (its KV may be written in the
        # target forward, its attention runs in the draft step, planned by the speculator).
        target_layers = set(layers) - self._draft_layer_names()
        self._target_group_ids = tuple(i for i, g in enumerate(groups)
                                       if target_layers.intersection(g.layer_names))
        self._kv_write_only_groups = tuple(i for i in range(len(groups))
                                           if i not in self._target_group_ids)
        self._write_only_entries: dict[int, dict[str, KVWriteOnlyMetadata]] = {}
        # The last graph step's (shape, row slots, attention metadata): the next graph step
        # with the same rows carries it over (_advance_graph_step) where
        # VLLM_GRAPH_STEP_ADVANCE is not "0" (on by default).
        self._held_graph_step = None
        self._graph_step_advance = graph_step_advance_enabled()
        # Plain steps that skip a block drafter's context-KV write, refilled before its next
        # draft pass (context_refill.py; opt-in).
        self._context_refill = self._make_context_refill()
        for builder in self.attn_metadata_builders:
            # Rows of at most 1 + k tokens (decode / verify, draft blocks) take the decode path;
            # longer rows (prefill chunks, with or without context) the prefill path.
            builder.reorder_batch_threshold = 1 + self.num_spec_tokens
            if hasattr(builder, "_row_buffers"):  # allocate once: graphs capture the addresses
                builder._row_buffers(self.max_num_tokens, self.device)
        if self.cudagraphs is not None:
            if any(getattr(b, "kernel_family", "hopper") != "hopper"
                   for b in self.attn_metadata_builders):
                logger.warning("CUDA graphs are not wired for the FlashInfer Blackwell path yet; "
                               "running eagerly")
                self.cudagraphs = None
                self._graph_managers = {}
            else:
                self.capture_model()
        self._warm_moe_kernels()
        self._warm_context_refill()

    def _warm_moe_kernels(self) -> None:
        """Compile the MoE kernels' forms for every token count a step can carry here, not in
        the first serving step that needs one (moe_warmup.py: an eager pass of a new length
        compiled a kernel for 0.25-0.43 s on the H100)."""
        if self.device.type != "cuda":
            return
        from vllm.model_executor.layers.moe_warmup import warm_moe_kernels
        warm_moe_kernels((self.model, self.draft_model), self.max_num_tokens)

    def _make_context_refill(self) -> ContextRefillTracker | None:
        """The refill tracker where VLLM_DRAFT_CONTEXT_REFILL=1 applies (a block drafter with a
        speculation policy), and the Q=1 graphs without the context write it replays."""
        self._context_free_graphs = None
        if not refill_enabled():
            return None
        spec = self.speculator
        if spec is None or not getattr(spec, "can_skip_propose", False):
            # (benchmarks switch the flag for a plain engine and a DSpark one in one process)
            logger.warning("%s=1 has no effect here: only block drafters (dflash, dspark) "
                           "write context KV in the target step", REFILL_FLAG)
            return None
        if spec.defers_context:
            raise ValueError(f"{REFILL_FLAG}=1 and VLLM_DEFER_DRAFT_CONTEXT_KV=1 are two answers "
                             "to one question (the drafter's context KV of plain steps); set "
                             "one of them to 0")
        if getattr(self.spec_config, "disable_by_batch_size", None) is None:
            logger.warning("%s=1 has no effect without speculative_config "
                           "disable_by_batch_size: every step is followed by a draft pass",
                           REFILL_FLAG)
            return None
        plain = self._graph_managers.get(1)
        if plain is not None:
            from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
            self._context_free_graphs = CudaGraphManager(plain.capture_sizes, 1, self.device)
        # the layers whose slot mappings a refill pass sets to -1 (it writes no target KV)
        groups = self.kv_cache_config.kv_cache_groups
        self._refill_target_layers = [name for g in self._target_group_ids
                                      for name in groups[g].layer_names]
        return ContextRefillTracker(self.max_num_reqs)

    @torch.inference_mode()
    def capture_model(self) -> None:
        for q, manager in self._graph_managers.items():
            manager.capture_all(lambda size, q=q: self._dummy_graph_batch(size, q), self._forward)
        if self._context_free_graphs is not None:
            # Q=1 steps after which nobody drafts, refill on: the target alone.
            self._context_free_graphs.capture_all(
                lambda size: self._dummy_graph_batch(size, 1),
                lambda batch: self._forward(batch, write_context=False))
        self._warm_early_block_write()
        if any(hasattr(b, "advance_decode_plan_on_device") for b in self.attn_metadata_builders):
            # the plan lowering (early draft steps, graph-step advances) JIT-compiles here, not
            # in a serving step
            from vllm.v1.attention.backends.mla.plan_lowering import (warm_page_list_rebuild,
                                                                      warm_plan_lowering)
            warm_plan_lowering(self.device)
            for bound in {b.max_plan_requests for b in self.attn_metadata_builders
                          if getattr(b, "page_list_rebuild", False)}:
                warm_page_list_rebuild(self.device, bound)
        self._held_graph_step = None  # the dummy batches' metadata carries no real step
        # The dummy batches wrote into slots' host state; hand every slot back clean.
        self.requests.num_computed.np[:] = 0
        spec = self.speculator
        if spec is not None and spec.defers_context:
            spec.reset_context()  # the dummy steps queued context rows
        if (spec is not None and hasattr(spec, "capture_graphs")
                and spec.draft_sample_method == "greedy"):
            from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
            spec.capture_graphs(CudaGraphManager(self.cudagraphs.capture_sizes, spec.query_len,
                                                 self.device))

    def _dummy_graph_batch(self, num_reqs_padded: int, q: int) -> InputBatch:
        """A uniform decode batch of num_reqs_padded rows of q tokens over slots 0.. (block 0,
        KV empty)."""
        if self.speculator is not None and self.speculator.defers_context:
            # Warm-up + replay of each size append to the ring; start every size empty.
            self.speculator.reset_context()
        rows = []
        for slot in range(num_reqs_padded):
            rows.append(RequestState(f"_graph_{slot}", slot, [], 1))
            self.requests.num_computed.np[slot] = 1
        layout = (rows, [q] * num_reqs_padded, [q - 1] * num_reqs_padded,
                  [True] * num_reqs_padded, [None] * num_reqs_padded)
        return self._build_batch(layout, num_reqs_padded, cudagraph=True, advance=False)

    # ------------------------------------------------------------ state update
    def _update_states(self, scheduler_output: Any) -> None:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        for req_id in set(scheduler_output.finished_req_ids) | set(
                scheduler_output.preempted_req_ids):
            state = self.requests.remove(req_id)
            self.sampling_states.remove_request(
                req_id, state.slot if state is not None else None,
                finished=req_id in scheduler_output.finished_req_ids)
            if state is not None:
                self._has_draft_probs[state.slot] = False
                self.block_tables.remove_request(state.slot)
                if self._context_refill is not None:
                    self._context_refill.forget(state.slot)
            if req_id in scheduler_output.finished_req_ids:
                self.generators.remove_request(req_id)

        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.requests:  # re-admitted after a preemption we did not see
                self.block_tables.remove_request(self.requests.remove(new.req_id).slot)
            state = self.requests.add(new.req_id, new.prompt_token_ids, new.num_computed_tokens,
                                      new.sampling_params)
            if self._context_refill is not None:
                self._context_refill.forget(state.slot)
            self.block_tables.append_block_ids(state.slot, (list(new.block_ids),) * num_groups,
                                               overwrite=True)
            # Idempotent per request id: a preempted request keeps its generator and its draws.
            self.generators.add_request(new.req_id, new.sampling_params)
            self.sampling_states.add_request(new.req_id, state.slot, new.prompt_token_ids,
                                             new.sampling_params)
            params = new.sampling_params
            greedy = is_greedy(params)
            self._greedy_np[state.slot] = greedy
            self._temperature.np[state.slot] = 0.0 if greedy else float(params.temperature)
            self._top_k.np[state.slot] = max(int(getattr(params, "top_k", 0) or 0), 0) \
                if params is not None else 0
            self._top_p.np[state.slot] = float(getattr(params, "top_p", 1.0)) \
                if params is not None else 1.0

        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests[req_id]
            if int(num_computed) != state.num_computed_tokens:
                raise ValueError(
                    f"request {req_id!r}: scheduler says {int(num_computed)} computed tokens but "
                    f"the runner computed {state.num_computed_tokens} (it holds "
                    f"{len(state.token_ids)} tokens); the two must advance in lock-step")
            if new_block_ids:
                self.block_tables.append_block_ids(state.slot, (list(new_block_ids),) * num_groups,
                                                   overwrite=False)

    # ------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        """Run one step and return its output (waits for the step's one transfer)."""
        return self.execute_model_async(scheduler_output, overlap=False).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: Any,
                            overlap: bool = True) -> AsyncModelRunnerOutput:
        """Enqueue one step. With `overlap` (async scheduling) a step that needs no host token
        ids (no drafter, no penalties / logits processors / logprobs) returns before its
        sampled ids reach the host; `get_output()` collects them. Other steps complete here."""
        if self.kv_cache_config is None:
            raise RuntimeError("call initialize_kv_cache() before execute_model()")
        started = time.perf_counter()
        self._retire_previous_step()
        if self.speculator is not None:
            self.speculator.discard_early()  # a draft prepared early is for its own step only
        refill = self._context_refill
        if refill is not None and refill.any_stale and getattr(
                scheduler_output, "propose_drafts", True):
            self._refill_draft_context(scheduler_output)  # the draft pass after this step reads it
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(
                req_ids=[], sampled_token_ids=[], spec_token_ids=[] if self.speculator else None))
        batch = self._prepare_inputs(scheduler_output)
        deferred = self._before_context_write(batch, scheduler_output)
        skip_context = refill is not None and self._skips_context(batch, scheduler_output)
        overlap = overlap and self._can_overlap(batch, scheduler_output)
        if overlap and self._inputs_event is not None:
            # Every pinned host twin of this step has been copied once the GPU gets here; the
            # next step's host writes wait for it (not for the whole step).
            record_event(self._inputs_event)
            self._wait_inputs = True
        num_reqs = batch.num_reqs
        if batch.cudagraph:
            manager = (self._context_free_graphs if skip_context
                       else self._graph_managers[batch.uniform_query_len])
            hidden, aux_hidden, logits_all = manager.replay(batch.num_reqs_padded)
            # Uniform decode: every real token is a logit row, in order.
            logits = logits_all[: batch.num_tokens]
        else:
            # (the keyword only where it applies: host benchmarks stand in for _forward)
            hidden, aux_hidden, logits_all = (self._forward(batch, write_context=False)
                                              if skip_context else self._forward(batch))
            logits = logits_all
        if skip_context:
            n = batch.num_reqs
            refill.note_skipped(batch.idx_mapping_np[:n], batch.num_computed_np[:n])
        if deferred:
            self.speculator.note_context_appended(batch.num_tokens_padded)

        prompt_logprobs = None
        # Prompt rows (never in a graph) may ask for prompt logprobs, also chunk by chunk; while
        # no admitted request waits for them, nothing per request is built.
        if not batch.cudagraph and self.sampling_states.wants_prompt_logprobs:
            prompt_logprobs = self.sampling_states.prompt_logprobs(
                self.model.compute_logits, hidden, batch.req_ids,
                batch.query_start_loc_np[: num_reqs + 1].tolist(),
                [self.requests[r].token_ids for r in batch.req_ids],
                batch.num_computed_np[:num_reqs].tolist())
        sampled, num_sampled, num_draft, sample_rows, rows_info = self._sample(batch, logits)
        if overlap and sampled is not None and self._sample_event is not None:
            # The eager sampling path copied host twins after the forward was enqueued.
            record_event(self._sample_event)
            self._wait_sample = True
        # The step's one device->host transfer.
        if overlap:
            index, event, _ = self._copy_step_output(sampled, num_sampled, len(sample_rows),
                                                     wait=False)
            return self._launched(batch, sample_rows, index, event)
        index, event, _ = self._copy_step_output(sampled, num_sampled, len(sample_rows),
                                                 wait=False)
        # The draft's inputs and metadata, while the verify step runs (early_draft.py).
        self._prepare_draft_early(batch, scheduler_output, sample_rows)
        host = self._step_buffers.wait(index, event, len(sample_rows))
        previous = self._inflight
        if previous is not None and not previous.done:
            previous.get_output()  # collected in launch order (its copy finished before ours)
        output = self._finish_step(batch, scheduler_output, hidden, aux_hidden, logits,
                                   prompt_logprobs, host, num_draft, sample_rows, rows_info)
        timing = self._early_timing
        if timing is not None:  # the early draft step's A/B (early_draft.EarlyDraftTuner)
            self._early_timing = None
            timing[0].observe(timing[1], timing[2], time.perf_counter() - started)
        return AsyncModelRunnerOutput.ready(output)

    def _finish_step(self, batch: InputBatch, scheduler_output: Any, hidden, aux_hidden, logits,
                     prompt_logprobs, host: np.ndarray, num_draft, sample_rows,
                     rows_info) -> ModelRunnerOutput:
        """Host bookkeeping of a completed (synchronous) step, then the drafter's proposal."""
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids
        out_tokens: list[list[int]] = [[] for _ in range(num_reqs)]
        num_accepted = [0] * num_reqs
        num_draft_list = [0] * num_reqs
        num_computed_new = batch.num_computed_np + batch.num_scheduled_np
        num_sample_rows = len(sample_rows)
        if self.num_spec_tokens == 0 or not num_draft.any():
            # Plain decoding, or a speculative step in which nobody verified drafts (the policy
            # let nobody draft): one token per sampling row, nothing rejected.
            for row, token in zip(sample_rows, host[:num_sample_rows, 0].tolist()):
                out_tokens[row] = [token]
        else:
            # Verified step: whole-array numpy counts (spec_decode/step_output.py).
            num_draft_list, num_accepted = apply_verified_step(
                host, num_draft, sample_rows, num_reqs, num_computed_new, out_tokens)
        # Counts for penalties / min_tokens, and logprobs of requests that asked (computed from
        # the raw logits; a step with none of these features does nothing here).
        # (A step whose rows use none of them skips the call: needs_host_tokens covers every
        # slot with a feature or logprobs, the only ones after_sampling touches.)
        logprobs = None
        if sample_rows and self.sampling_states.needs_host_tokens(rows_info.slots):
            logprobs = self.sampling_states.after_sampling(
                logits, rows_info, [out_tokens[r] for r in sample_rows])
        by_id = self.requests.by_id
        self.requests.num_computed.np[batch.idx_mapping_np[:num_reqs]] = num_computed_new
        for req_id, tokens, value in zip(req_ids, out_tokens, num_computed_new.tolist()):
            state = by_id[req_id]
            state.token_ids.extend(tokens)
            state.num_computed_tokens = value  # (the slot twin was set above)

        spec_token_ids = None
        # A drafter whose context KV is written inside the target forward (block drafters) may
        # skip its draft pass when nobody uses the drafts: the policy lets nobody draft, or every
        # row is an unfinished prefill chunk (drafting starts when the prefill finishes).
        skippable = getattr(self.speculator, "can_skip_propose", False)
        nobody_samples = not bool(batch.samples_np[:batch.num_reqs].any())
        if self.speculator is not None and not (skippable and nobody_samples) and (
                getattr(scheduler_output, "propose_drafts", True) or not skippable):
            self.speculator.flush_context()  # the draft pass reads the context KV
            spec_token_ids = self._propose(batch, hidden, aux_hidden, sample_rows,
                                           num_computed_new, out_tokens)
        elif self.speculator is not None:
            # The policy lets nobody draft: no draft pass. One shared empty list (the scheduler
            # copies each row's list).
            spec_token_ids = [[]] * len(req_ids)
            self._last_drafts = None  # no drafts were proposed by this step
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=out_tokens,
                                 spec_token_ids=spec_token_ids, num_draft_tokens=num_draft_list,
                                 num_accepted_tokens=num_accepted, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs)

    def _forward(self, batch: InputBatch, write_context: bool = True) -> tuple:
        """Target forward (+ block drafters' context KV) and the LM head of the logit rows.
        In graph mode (captured) the logit rows are all padded tokens, in order.
        `write_context=False`: the target alone (no taps, no context KV; context_refill.py)."""
        aux_layers = (self.speculator.aux_hidden_state_layers
                      if self.speculator is not None and write_context else ())
        aux_hidden = None
        input_ids, positions = batch.input_ids, batch.positions
        with set_forward_context(batch.attn_metadata, self.vllm_config):
            if aux_layers:
                # [T, J * hidden], written by the norms that sum the tapped streams
                hidden, aux_hidden = self.model(input_ids, positions,
                                                aux_hidden_state_layers=aux_layers)
            else:
                hidden = self.model(input_ids, positions)
            if self.speculator is not None and write_context:
                # Block drafters store context KV of the processed tokens through the draft
                # group's slot mapping of this very step (or queue it: _defers_context).
                self.speculator.precompute_context(aux_hidden, positions,
                                                   defer=self._defers_context(batch))
        if batch.cudagraph:
            logits = self.model.compute_logits(hidden)
            # Captured with the forward: the greedy verification of the uniform batch
            # (used when _sample's host checks allow it; see graph_sampling.py).
            captured_greedy_step(logits, batch.num_reqs_padded, batch.uniform_query_len,
                                 batch.idx_mapping[: batch.num_reqs_padded],
                                 batch.query_start_loc[: batch.num_reqs_padded + 1],
                                 self.requests.draft_tokens, self.requests.last_sampled,
                                 self.requests.scratch_slot, self._step_buffers.gpu)
        else:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        return hidden, aux_hidden, logits

    def _skips_context(self, batch: InputBatch, scheduler_output: Any) -> bool:
        """With refill on: a uniform Q=1 decode step after which nobody drafts runs the target
        alone (graph: the context-free capture). Prefill chunks and verify steps write context
        KV as always (a refill would repeat their whole forward)."""
        if getattr(scheduler_output, "propose_drafts", True) or batch.uniform_query_len != 1:
            return False
        return not batch.cudagraph or self._context_free_graphs is not None

    def _refill_draft_context(self, scheduler_output: Any) -> None:
        """Write the draft context KV of the stale positions of this step's rows (the draft
        pass after this step reads it): target forwards over those positions (decode rows of
        any length, see refill_through_decode) that tap the hidden states and store the
        drafter's context KV and no target KV (context_refill.py). Runs before the step's
        state update: the block ids that update appends reach the device as patches that only
        the step's own batch build applies (every patched slot is one of its rows), and the
        builders' persistent buffers then hold the step's own metadata. Rows are the step's
        resident requests (a re-admitted one starts afresh: _update_states replaces its
        state)."""
        refill = self._context_refill
        by_id = self.requests.by_id
        admitted = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        pieces = refill.stale_pieces(
            [by_id[r] for r in scheduler_output.num_scheduled_tokens
             if r in by_id and r not in admitted])
        if not pieces:
            return
        if self._inflight is not None and not self._inflight.done and any(
                -1 in p.state.token_ids[p.start:p.end] for p in pieces):
            # A token of the range is still a placeholder of an overlapped step: collect it
            # (in launch order; the engine's own get_output() later returns the same output).
            self._inflight.get_output()
        started = time.perf_counter()
        self._refill_pieces(pieces)
        refill.refilled(pieces)
        self.context_refills += 1
        self.context_refill_tokens += sum(p.num_tokens for p in pieces)
        self.context_refill_seconds += time.perf_counter() - started

    def _refill_pieces(self, pieces: list) -> None:
        """The refill's forward passes over these RefillPieces (see _refill_draft_context)."""
        num_computed = self.requests.num_computed.np
        spec = self.speculator
        aux_layers = spec.aux_hidden_state_layers
        decode_builders = self._refill_decode_builders()
        thresholds = [b.reorder_batch_threshold for b in decode_builders]
        for chunk in chunk_pieces(pieces, self.max_num_tokens, self.max_num_reqs):
            layout = ([p.state for p in chunk], [p.num_tokens for p in chunk], [0] * len(chunk),
                      [False] * len(chunk), [p.state.token_ids[p.start:p.end] for p in chunk])
            for p in chunk:  # the builder reads each row's context length by slot
                num_computed[p.state.slot] = p.start
            for builder in decode_builders:
                # Every row a decode row (see refill_through_decode).
                builder.reorder_batch_threshold = max(p.num_tokens for p in chunk)
            try:
                batch = self._build_batch(layout, None, cudagraph=False)
            finally:
                for p in chunk:
                    num_computed[p.state.slot] = p.state.num_computed_tokens
                for builder, threshold in zip(decode_builders, thresholds):
                    builder.reorder_batch_threshold = threshold
            for name in self._refill_target_layers:
                # The target's KV of these positions is in the cache already: write none.
                batch.attn_metadata[name].slot_mapping.fill_(-1)
            with set_forward_context(batch.attn_metadata, self.vllm_config):
                _, aux_hidden = self.model(batch.input_ids, batch.positions,
                                           aux_hidden_state_layers=aux_layers)
                spec.precompute_context(aux_hidden, batch.positions)
            if self._inputs_event is not None:
                # The next build rewrites the pinned host twins this one copies from.
                record_event(self._inputs_event)
                self._inputs_event.synchronize()

    # Refill passes run the target's attention as decode rows of any length (the causal
    # multi-token decode kernels, reading every position's KV from the cache, where the plain
    # steps wrote it) instead of prefill rows with context. Why: the prefill path of a model
    # whose head dims FlashInfer's prefill does not serve (the tiny model's 96/32) is torch
    # loops per row and per tile, ~11k ATen ops for 8 rows x 8 tokens on the CPU; the decode
    # path is batched, one kernel per layer on FlashInfer. It also reads the very KV the plain
    # steps' decode read. False: the prefill path (scripts/time_context_refill.py compares).
    refill_through_decode = True

    def _refill_decode_builders(self) -> list:
        """The target groups' builders whose threshold a refill pass raises (none when
        refill_through_decode is off, or a builder is not a Hopper/torch one: the Blackwell
        native kernel takes one query length per batch)."""
        if not self.refill_through_decode:
            return []
        builders = [self.attn_metadata_builders[g] for g in self._target_group_ids]
        if any(getattr(b, "kernel_family", "hopper") != "hopper" for b in builders):
            return []
        return builders

    @torch.inference_mode()
    def _warm_context_refill(self, on_cpu: bool = False) -> None:
        """Run the refill's kinds of pass once at start-up, over slots 0-1 (block 0, as the
        graph captures' dummy batches), so that first-use costs of their eager kernels (Triton
        specialises on integer arguments: 1, a multiple of 16, other; libraries load kernels
        lazily) land here, not in a serving step. Why: every refill measured on the H100 cost
        345-1,858 plain steps (~0.2-0.9 s), far more than its work (thirty-seventh session).
        These passes did not remove that: the cause was the MoE kernels compiling a new form
        for each new power-of-two bucket of a pass's pairs (fortieth session,
        scripts/time_context_refill.py: one kernel compiled, 249-430 ms, against 6-7 ms on
        the repeat), which _warm_moe_kernels now compiles for every token count at start-up."""
        if self._context_refill is None or (self.device.type != "cuda" and not on_cpu):
            return
        # (with refill_through_decode off, rows up to q tokens take the decode path, longer ones
        # the prefill path; on, every row is a decode row, of these lengths)
        q = 1 + self.num_spec_tokens
        # (rows, start, tokens): one prefill-shaped row; a decode- and a prefill-shaped row
        # (other counts); the same with a multiple of 16 tokens in all
        for shape in ([(3, q + 2)], [(2, q - 1), (5, q + 3)], [(2, 1), (4, 15)]):
            if len(shape) > self.max_num_reqs:
                continue  # (a batch of one: its refills are one row too)
            pieces = [RefillPiece(RequestState(f"_refill_{slot}", slot, [0] * (start + m),
                                               start + m), start, start + m)
                      for slot, (start, m) in enumerate(shape)]
            self._refill_pieces(pieces)
        self.requests.num_computed.np[:] = 0  # hand every slot back clean
        self._held_graph_step = None

    # refill passes, the tokens they refilled and their host time, waits included
    # (context_refill.py; tests and probes read them)
    context_refills = 0
    context_refill_tokens = 0
    context_refill_seconds = 0.0
    _context_refill: ContextRefillTracker | None = None  # (set by initialize_kv_cache)
    _context_free_graphs = None

    def _defers_context(self, batch: InputBatch) -> bool:
        """Q=1 decode steps queue a block drafter's context KV when deferral is on
        (context_kv_ring.py); the same rule at capture and at replay."""
        return bool(self.speculator is not None and self.speculator.defers_context
                    and batch.uniform_query_len == 1)

    def _before_context_write(self, batch: InputBatch, scheduler_output: Any) -> bool:
        """Flush queued context KV where it must be written first: this step writes context KV
        directly (not a Q=1 decode), blocks were freed since (finished / preempted requests: a
        block may have a new owner whose writes must come after the stale ones), or this step's
        rows would not fit. Returns whether this step queues its own."""
        spec = self.speculator
        if spec is None or not spec.defers_context:
            return False
        defer = self._defers_context(batch)
        freed = bool(scheduler_output.finished_req_ids) or bool(
            getattr(scheduler_output, "preempted_req_ids", None))
        if not defer or freed or not spec.context_fits(batch.num_tokens_padded):
            spec.flush_context()
        return defer

    def _prepare_draft_early(self, batch: InputBatch, scheduler_output: Any,
                             sample_rows: list[int]) -> None:
        """Hand a block drafter what its draft pass needs before the step's output reaches
        the host (its prepare_early), when the pass will run and every row's new length
        follows from the device output alone: a uniform batch of Q-token rows that all sample,
        each verifying Q - 1 drafts (or none, Q = 1). The new computed count of a row is then
        seq_len - Q + (tokens it emitted), the emitted count being the last column of the
        packed step output (_copy_step_output has written it; stream order does the rest)."""
        spec = self.speculator
        wants = getattr(spec, "wants_early_draft", None)
        if wants is None or not wants():
            return
        n, q = batch.num_reqs, batch.uniform_query_len
        if (n == 0 or q == 0 or len(sample_rows) != n
                or not getattr(scheduler_output, "propose_drafts", True)
                or not bool((batch.num_draft_np[:n] == q - 1).all())):
            return
        tuner = spec.early_tuner
        if tuner is not None:
            # Mode "auto": this eligible step is timed for the A/B (execute_model_async).
            early = tuner.use_early(n)
            self._early_timing = (tuner, n, early)
            if not early:
                return
        upper = batch.num_computed_np[:n] + batch.num_scheduled_np[:n]
        accepted, next_tokens, terms = self._early_block_terms(batch, q)
        # every draft rejected: one token per row (the emitted one) is the lower bound
        drafts = spec.prepare_early(n, accepted, next_tokens, upper, batch.seq_lens_np[:n],
                                    lower_num_computed_new=upper - (q - 1), **terms)
        if drafts is not None:
            # The draft step was launched already (its plans lowered on the device): its drafts
            # go to their slots now too, in stream order, so that after the wait the proposal
            # is bookkeeping only (_propose).
            self.requests.draft_tokens[batch.idx_mapping[:n]] = drafts

    def _early_block_terms(self, batch: InputBatch, q: int) -> tuple:
        """What prepare_early gets for the draft block's anchors: the new computed count of row
        i is its target length + the tokens it emitted (the packed step output's last column)
        - Q, and its anchor the last sampled token of its request slot. Handed over as they lie
        on the device, the block input write combines them in its one launch (four torch ops
        before it did: a copy, an add, a sub and a gather). Returns (accepted, next token ids,
        keyword terms)."""
        emitted = self.__dict__.get("_emitted_column")
        if emitted is None:  # a persistent view: one slice, not one per step
            emitted = self._emitted_column = self._step_buffers.gpu[:, -1]
        return batch.seq_lens, self.requests.last_sampled, dict(
            accepted_extra=emitted, accepted_offset=-q, next_token_rows=batch.idx_mapping)

    def _warm_early_block_write(self) -> None:
        """Compile the early draft step's block input write (the kernel variant that reads
        the terms above) at start-up, next to the graph captures, instead of JIT-compiling it
        in the first early step (Triton, about a second). It writes one row of the drafter's
        own input buffers, which every draft step and the draft graphs' capture write again."""
        spec = self.speculator
        if (self.device.type != "cuda" or spec is None
                or not hasattr(spec, "prepare_early") or self.cudagraphs is None):
            return
        q = self.cudagraphs.query_len  # the verify rows' Q (the block's own is the drafter's)
        size = min(self.cudagraphs.capture_sizes)  # a batch size the dummy batch can pad to
        batch = self._dummy_graph_batch(size, q)
        accepted, next_tokens, terms = self._early_block_terms(batch, q)
        spec._write_block(size, size, accepted, next_tokens, **terms)
        if spec.fuses_plan_lowering():
            # ... and its variant that also lowers a held draft plan (prepare_early's fused
            # lowering), for both alignments of a wrapper's kv_len_arr (Triton specialises on
            # it; plan_lowering.warm_plan_lowering says why both occur). Scratch plan arrays.
            ws = torch.zeros(16, dtype=torch.int32, device=self.device)
            index = torch.zeros(4, dtype=torch.int64, device=self.device)
            arr = torch.zeros(size + 2, dtype=torch.int32, device=self.device)
            for offset in (0, 1):
                lowering = PlanLowering(ws, index, 1, 1, arr[offset:offset + size], size)
                spec._write_block(size, size, accepted, next_tokens, lowering=lowering, **terms)

    def _copy_step_output(self, sampled: torch.Tensor, num_sampled: torch.Tensor, rows: int,
                          wait: bool = True):
        """The step's one device->host transfer (pinned, non_blocking, event-completed).
        Returns (buffer index, event, host rows or None when not waited for)."""
        packed = self._step_buffers.gpu[:rows]
        if sampled is not None:  # None: the captured greedy step packed the rows already
            packed[:, : sampled.shape[1]].copy_(sampled)
            packed[:, -1].copy_(num_sampled)
        index, event = self._step_buffers.launch(packed)
        host = self._step_buffers.wait(index, event, rows) if wait else None
        return index, event, host

    # ------------------------------------------------------------ async steps
    def _can_overlap(self, batch: InputBatch, scheduler_output: Any) -> bool:
        """A step may return before its ids reach the host when nothing of the next step needs
        them there: no drafter pass after it (a drafter proposes from the accepted tokens), no
        drafts verified (the accepted counts are needed), and no row whose sampling reads host
        token history or returns logprobs."""
        if self.speculator is not None and not self._plain_step_without_proposal(
                batch, scheduler_output):
            return False
        return not self.sampling_states.needs_host_tokens(batch.idx_mapping_np[: batch.num_reqs])

    def _plain_step_without_proposal(self, batch: InputBatch, scheduler_output: Any) -> bool:
        """A speculative step that verifies no drafts and skips the draft pass (the condition
        `_finish_step` uses): a block drafter whose next step lets nobody draft, or whose rows
        are all unfinished prefill chunks. EAGLE / MTP run their draft pass every step."""
        if scheduler_output.scheduled_spec_decode_tokens:
            return False
        if not getattr(self.speculator, "can_skip_propose", False):
            return False
        # The policy's answer first: a numpy reduction over the rows costs the host ~3 us, and
        # this runs in every step of a speculative engine whose policy lets nobody draft.
        if not getattr(scheduler_output, "propose_drafts", True):
            return True
        return not bool(batch.samples_np[: batch.num_reqs].any())  # nobody samples

    def _launched(self, batch: InputBatch, sample_rows: list[int], index: int,
                  event) -> AsyncModelRunnerOutput:
        """Advance the host state as the step will leave it (exact without drafts: every
        scheduled token is computed, a sampling row gains one token) and hand back a handle."""
        states, positions = [], []
        num_computed_new = batch.num_computed_np + batch.num_scheduled_np
        # The host num_computed is only read on the host (the input builder stages its own
        # per-row copy), so it can advance now: the slot-indexed twin in one numpy scatter,
        # the per-request value in the loop below (RequestStates.set_num_computed, inlined).
        by_id = self.requests.by_id
        row_states = [by_id[req_id] for req_id in batch.req_ids]
        self.requests.num_computed.np[batch.idx_mapping_np[: batch.num_reqs]] = num_computed_new
        for state, value in zip(row_states, num_computed_new.tolist()):
            state.num_computed_tokens = value
        for row in sample_rows:
            state = row_states[row]
            states.append(state)
            token_ids = state.token_ids
            positions.append(len(token_ids))
            token_ids.append(-1)  # placeholder until get_output()
        step = LaunchedStep(req_ids=list(batch.req_ids), sample_rows=list(sample_rows),
                            states=states, positions=positions, buffer_index=index,
                            num_rows=len(sample_rows), event=event)
        if self.speculator is not None:
            self._last_drafts = None  # an overlapped step proposes nothing (_can_overlap)
        previous = self._inflight
        handle = AsyncModelRunnerOutput(_collect=lambda: self._collect(step, previous))
        self._inflight = handle
        return handle

    def _collect(self, step: LaunchedStep, previous: AsyncModelRunnerOutput | None
                 ) -> ModelRunnerOutput:
        if previous is not None and not previous.done:
            previous.get_output()  # launch order
        host = self._step_buffers.wait(step.buffer_index, step.event, step.num_rows)
        tokens = host[: step.num_rows, 0].tolist()
        num_rows = len(step.req_ids)
        if len(step.sample_rows) == num_rows:  # every row sampled (the steady decode)
            out_tokens = [[token] for token in tokens]
        else:
            out_tokens = [[] for _ in step.req_ids]
            for row, token in zip(step.sample_rows, tokens):
                out_tokens[row] = [token]
        by_id = self.requests.by_id
        for state, position, token in zip(step.states, step.positions, tokens):
            # A request dropped (finished, preempted) since the launch has no placeholder left
            # to fill; a re-admitted one is a new RequestState.
            if by_id.get(state.req_id) is state:
                state.token_ids[position] = token
        zeros = [0] * num_rows
        # A speculative step collected here proposed nothing: one shared empty list per row,
        # as `_finish_step` returns for a skipped draft pass.
        spec_token_ids = [[]] * num_rows if self.speculator is not None else None
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=out_tokens,
                                 spec_token_ids=spec_token_ids, num_draft_tokens=zeros,
                                 num_accepted_tokens=list(zeros))

    def _retire_previous_step(self) -> None:
        """Before this step writes pinned host twins: the previous (overlapped) step's copies
        that read them must have run. Its input copies ran before its forward, so this wait is
        short; copies made by eager sampling wait for its forward."""
        if self._wait_inputs:
            self._inputs_event.synchronize()
            self._wait_inputs = False
        if self._wait_sample:
            self._sample_event.synchronize()
            self._wait_sample = False

    def _sampling_metadata(self, batch: InputBatch, rows: list[int]) -> SamplingMetadata:
        """Sampling settings of the sampling rows, gathered on the device from the per-slot
        buffers (no tensor built from Python lists)."""
        row_slots = batch.idx_mapping_np[sampling_row_index(batch.num_reqs, rows)]
        greedy_np = self._greedy_np[row_slots]
        if greedy_np.all():
            # A view of a persistent zero buffer: no per-step allocation or copy.
            return SamplingMetadata(temperature=self._zero_temperature[: len(rows)],
                                    all_greedy=True, all_random=False)
        req_ids = [batch.req_ids[r] for r in rows]
        greedy = greedy_np.tolist()
        slots = self._pinned_index(row_slots, "sampling_slots")
        self._temperature.copy_to_gpu()
        self._top_k.copy_to_gpu()
        self._top_p.copy_to_gpu()
        top_k = self._top_k.gpu[slots] if any(self._top_k.np[row_slots] > 0) else None
        top_p = self._top_p.gpu[slots] if any(self._top_p.np[row_slots] < 1) else None
        gens = self.generators.for_batch(req_ids)
        gens = {i: g for i, g in gens.items() if not greedy[i]}
        return SamplingMetadata(temperature=self._temperature.gpu[slots], all_greedy=False,
                                all_random=not any(greedy), top_k=top_k, top_p=top_p,
                                generators=gens)

    def _sample(self, batch: InputBatch, logits: torch.Tensor):
        """Verify / sample the rows that sample this step, on the device.
        Returns (sampled [S, k+1], num_sampled [S], num_draft host [S], sampling row ids)."""
        samples = batch.samples_np[: batch.num_reqs]
        rows = (list(range(batch.num_reqs)) if samples.all()
                else np.flatnonzero(samples).tolist())
        metadata = self._sampling_metadata(batch, rows)
        self._step_sampling_metadata = metadata
        # (a copy: the batch's buffer is rewritten by the next step's build)
        index = sampling_row_index(batch.num_reqs, rows)
        num_draft = batch.num_draft_np[index].copy() if rows else np.zeros(0, dtype=np.int64)
        if batch.cudagraph and metadata.all_greedy and rows:
            rows_info = self._batch_rows(batch, rows, num_draft, None)
            if not self.sampling_states.any_active(rows_info):
                # The replayed graph verified greedily already (graph_sampling.py): the same
                # argmax, acceptance and last_sampled update the eager path below would make.
                return None, None, num_draft, rows, rows_info
        if not num_draft.any():
            # Nobody verifies drafts this step (a plain engine, or the policy let nobody draft):
            # sample as a plain engine does, without the verification layout and draft gather.
            # With zero drafts the rejection sampler's result and its generator draws are
            # exactly the sampler's (tests/v1/sample: zero-draft equivalence); without one the
            # general path below makes the same sampler call and the same last_sampled update.
            return self._sample_plain(batch, logits, metadata, rows, num_draft)
        if metadata.all_greedy and self.rejection_sampler is not None:
            rows_info = self._batch_rows(batch, rows, num_draft, None)
            if not self.sampling_states.any_active(rows_info):
                # Greedy with raw logits: the verification is a function of the argmax and the
                # device drafts; one launch packs the step output and sets the next anchors
                # (the rejection sampler's exact result; tests/v1/sample/test_greedy_verify.py).
                self._verify_greedy(batch, logits, rows)
                return None, None, num_draft, rows, rows_info
        # One host layout of the verified drafts serves the draft gather, q and verification.
        layout = verification_layout(num_draft)
        draft_slots = batch.idx_mapping_np[rows][layout["draft_req"]] if rows else \
            np.zeros(0, dtype=np.int64)
        draft_pos = layout["draft_pos"]
        drafts = self._verified_drafts(draft_slots, draft_pos)
        rows_info = self._batch_rows(batch, rows, num_draft, drafts)
        raw_logits = logits
        logits = self.sampling_states.process_logits(raw_logits, rows_info)
        if self.rejection_sampler is not None:
            result = self.rejection_sampler.verify(
                logits, drafts, num_draft, metadata,
                self._draft_probs_for(draft_slots, draft_pos, drafts, logits.shape[-1]),
                layout=layout,
                to_device=lambda values, name: self._pinned_index(values, "rs_" + name))
            sampled, num_sampled = result.sampled, result.num_sampled
        else:
            sampled = self.sampler(logits, metadata).unsqueeze(1)
            num_sampled = torch.ones(len(rows), dtype=torch.int64, device=self.device)
        # Device state: the emitted token is the next step's anchor.
        if rows:
            slots = self._pinned_index(batch.idx_mapping_np[rows], "sampled_slots")
            emitted = sampled.gather(1, (num_sampled - 1).unsqueeze(1)).squeeze(1)
            self.requests.last_sampled[slots] = emitted
        return sampled, num_sampled, num_draft, rows, rows_info

    def _verify_greedy(self, batch: InputBatch, logits: torch.Tensor, rows: list[int]) -> None:
        """Greedy verification of an eager step (ragged rows): writes the packed step output
        (`_step_buffers.gpu`, as the captured graph does) and last_sampled of every sampling row."""
        n = len(rows)
        row_index = (self._row_arange if n == batch.num_reqs
                     else self._pinned_index(rows, "verify_rows"))
        self._greedy_verify(logits.argmax(dim=-1), batch.cu_num_logits, batch.idx_mapping,
                            row_index, self.requests.draft_tokens, self.requests.last_sampled,
                            self._step_buffers.gpu, n)

    def _batch_rows(self, batch: InputBatch, rows: list[int], num_draft: np.ndarray,
                    drafts) -> BatchRows:
        """The sampling rows for the sampling extras. The host token history (read only by
        multi-token bad words, a featured slot) is attached only when a row has features."""
        req_ids = [batch.req_ids[r] for r in rows] if len(rows) != batch.num_reqs \
            else list(batch.req_ids)
        index = sampling_row_index(batch.num_reqs, rows)
        rows_info = BatchRows(req_ids, batch.idx_mapping_np[index].tolist(),
                              num_draft=num_draft.tolist(), draft_tokens=drafts)
        if self.sampling_states.any_active(rows_info):
            by_id = self.requests.by_id
            rows_info.token_ids = [by_id[r].token_ids for r in req_ids]
        return rows_info

    def _sample_plain(self, batch: InputBatch, logits: torch.Tensor, metadata: SamplingMetadata,
                      rows: list[int], num_draft: np.ndarray):
        """Sampling of a step of a speculative engine in which nobody verifies drafts: what a
        plain engine does (no verification layout, draft gather or rejection sampler)."""
        rows_info = self._batch_rows(batch, rows, num_draft, None)
        logits = self.sampling_states.process_logits(logits, rows_info)
        sampled = self.sampler(logits, metadata).unsqueeze(1)
        if rows:
            index = sampling_row_index(batch.num_reqs, rows)
            slots = self._pinned_index(batch.idx_mapping_np[index], "sampled_slots")
            self.requests.last_sampled[slots] = sampled[:, 0]
        # every row of such a step samples exactly one token (a read-only persistent buffer)
        return sampled, self._ones[: len(rows)], num_draft, rows, rows_info

    def _verified_drafts(self, slots: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        """Flat [D] drafts verified this step (request slot and index of each), read from the
        slot-indexed draft buffer."""
        if len(slots) == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        idx = self._pinned_index(slots * self.requests.draft_tokens.shape[1] + pos, "drafts")
        return self.requests.draft_tokens.view(-1)[idx]

    def _draft_probs_for(self, slots: np.ndarray, pos: np.ndarray, drafts: torch.Tensor,
                         vocab: int) -> torch.Tensor | None:
        """q of the drafts verified this step ([total drafts, V]) gathered from the slot-indexed
        buffer, or None for greedy drafting (q is then one-hot on each draft)."""
        if self.speculator is None or self.speculator.draft_sample_method == "greedy":
            return None
        if len(slots) == 0:
            return None
        one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
        if self._draft_probs is None or not self._has_draft_probs[slots].any():
            return one_hot
        k = self._draft_probs.shape[1]
        flat = self._pinned_index(slots * k + pos, "draft_probs")
        q = self._draft_probs.view(-1, vocab)[flat]
        has = self._pinned_index(self._has_draft_probs[slots].astype(np.int64), "has_q")
        # Drafts not sampled here (scheduler-provided): q is one-hot on them.
        return torch.where(has[:, None] > 0, q, one_hot)

    def _propose(self, batch: InputBatch, hidden: torch.Tensor, aux_hidden, sample_rows,
                 num_computed_new: np.ndarray, out_tokens: list[list[int]]) -> list[list[int]]:
        num_reqs = batch.num_reqs
        placeholder = [-1] * self.num_spec_tokens
        drafts = self.speculator.consume_early_launch()
        if drafts is not None:
            # Launched before the wait and written to their slots (_prepare_draft_early):
            # greedy drafts (no q), every row sampled (the early path's condition).
            self._last_drafts = (batch.req_ids, drafts)
            self._draft_probs = None
            self._has_draft_probs[batch.idx_mapping_np[:num_reqs]] = False
            return [placeholder] * num_reqs
        ncn = self._num_computed_new
        ncn.np[:num_reqs] = num_computed_new
        ncn.copy_to_gpu(num_reqs)
        last_accepted_dev = None
        if getattr(self.speculator, "needs_last_accepted_index", True):
            qsl = batch.query_start_loc_np[: num_reqs + 1].astype(np.int64)
            # Rows that sampled nothing (unfinished prefill chunks) draft from their last token
            # too; their drafts are never verified.
            num_new = num_computed_new - batch.num_computed_np
            last_accepted = qsl[:num_reqs] + np.maximum(num_new, 1) - 1
            last_accepted_dev = self._pinned_index(last_accepted, "last_accepted")
        samples = batch.samples_np[:num_reqs]
        all_sample = bool(samples.all())
        if not all_sample:
            unfinished = np.flatnonzero(~samples)
            # An unfinished prefill chunk drafts from the next prompt token (EAGLE/MTP then write
            # their KV for the chunk's positions); those drafts are never verified.
            slots = batch.idx_mapping_np[unfinished]
            nxt = [self.requests[batch.req_ids[i]].token_ids[int(num_computed_new[i])]
                   for i in unfinished.tolist()]
            self.requests.last_sampled[self._pinned_index(slots, "unfinished_slots")] = \
                self._pinned_index(nxt, "unfinished_next")
        row_slots = batch.idx_mapping[:num_reqs]
        next_tokens = self.requests.last_sampled[row_slots]
        draft_inputs = DraftInputs(
            num_reqs=num_reqs,
            query_start_loc_np=batch.query_start_loc_np[: num_reqs + 1],
            target_input_ids=batch.input_ids[: batch.num_tokens],
            target_positions=batch.positions[: batch.num_tokens],
            target_hidden_states=hidden,
            target_seq_lens_cpu=torch.from_numpy(batch.seq_lens_np[:num_reqs].copy()),
            num_computed_new=num_computed_new,
            last_accepted_index=last_accepted_dev,
            next_token_ids=next_tokens,
            aux_hidden_states=aux_hidden,
            sampling_metadata=self._full_sampling_metadata(batch, sample_rows),
            num_computed_new_dev=ncn.gpu[:num_reqs],
            target_seq_lens=batch.seq_lens[:num_reqs],
            slots=row_slots,
        )
        drafts, probs = self.speculator.propose(draft_inputs)
        self.requests.draft_tokens[row_slots] = drafts
        self._last_drafts = (batch.req_ids, drafts)
        self._draft_probs = probs
        self._has_draft_probs[batch.idx_mapping_np[:num_reqs]] = probs is not None
        # Placeholders: the drafts stay on the device; the scheduler only needs their number
        # (it copies each list). An unfinished prefill chunk proposes nothing (its drafts are
        # never verified).
        if all_sample:
            return [placeholder] * num_reqs
        return [placeholder if s else [] for s in samples.tolist()]

    def _pinned_index(self, values, name: str) -> torch.Tensor:
        """Host int64 values -> device through a pinned buffer owned by `name` (one buffer per
        use site: a pinned region is written once per step, see buffer_utils)."""
        bufs = self.__dict__.setdefault("_index_bufs", {})
        buf = bufs.get(name)
        if buf is None:
            buf = bufs[name] = CpuGpuBuffer(self.max_num_tokens, dtype=torch.int64,
                                            device=self.device)
        values = np.asarray(values, dtype=np.int64)
        n = len(values)
        buf.np[:n] = values
        return buf.copy_to_gpu(n)

    def _full_sampling_metadata(self, batch: InputBatch, sample_rows: list[int]):
        """Sampling metadata over every batch row (probabilistic drafting samples per request)."""
        if self.speculator.draft_sample_method == "greedy":
            return None
        if len(sample_rows) == batch.num_reqs:
            return self._step_sampling_metadata
        return self._sampling_metadata(batch, list(range(batch.num_reqs)))

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts proposed by the last step, on the host (a sync: tests and tools only; the
        engine never needs the ids, they stay in the device draft buffer)."""
        if self._last_drafts is None:
            return {}
        req_ids, drafts = self._last_drafts
        return dict(zip(req_ids, drafts.tolist()))

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, scheduler_output: Any) -> InputBatch:
        """Lay out the step (host), build the InputBatch (device prep) and its metadata."""
        layout = self._steady_decode_layout(scheduler_output)
        if layout is None and scheduler_output.scheduled_spec_decode_tokens:
            layout = self._steady_verify_layout(scheduler_output)
        if layout is None:
            layout = self._general_layout(scheduler_output)
        rows, counts, _, samples, host_ids = layout
        padded = None
        manager = self._graph_managers.get(counts[0]) if counts else None
        if manager is not None:
            # list.count runs in C: no per-request Python loop on the steady path
            q, n = manager.query_len, len(rows)
            if counts.count(q) == n and samples.count(True) == n and host_ids.count(None) == n:
                padded = manager.padded_num_reqs(n)
        return self._build_batch(layout, padded, cudagraph=padded is not None)

    def _steady_decode_layout(self, scheduler_output: Any):
        """The layout of a step in which every row is a plain one-token decode of a started
        request (no admission, no drafts), in one lean pass; None when any row is not, and
        `_general_layout` lays the step out. For such a step the general layout keeps the
        scheduler's order and gives every row (1 token, 0 drafts, samples, ids from the device
        state), which is what this returns."""
        if scheduler_output.scheduled_new_reqs or scheduler_output.scheduled_spec_decode_tokens:
            return None
        by_id = self.requests.by_id
        rows = []
        max_model_len = self.max_model_len
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            state = by_id.get(req_id)
            if state is None or count != 1:
                return None
            start = state.num_computed_tokens
            if start + 1 != len(state.token_ids) or start < state.num_prompt_tokens or start == 0:
                return None  # a prefill chunk (or a re-admitted request's first token)
            if start + 1 > max_model_len:
                return None  # the general layout raises the error
            rows.append(state)
        n = len(rows)
        return rows, [1] * n, [0] * n, [True] * n, [None] * n

    def _steady_verify_layout(self, scheduler_output: Any):
        """The layout of a step in which every row is a decode of a started request verifying
        its own device drafts (the scheduler's placeholders, -1) or none, in one lean pass; None
        when any row is not (a prefill, an admission, scheduler-provided draft ids, a count that
        does not match the drafts), and `_general_layout` lays the step out (and raises what it
        raises). For such a step the general layout keeps the scheduler's order and gives every
        row (1 + drafts tokens, its drafts, samples, ids from the device state), no forced
        drafts: what this returns."""
        if scheduler_output.scheduled_new_reqs:
            return None
        by_id = self.requests.by_id
        spec = scheduler_output.scheduled_spec_decode_tokens
        threshold = 1 + self.num_spec_tokens
        max_model_len = self.max_model_len
        rows, counts, num_drafts = [], [], []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            state = by_id.get(req_id)
            if state is None:
                return None
            start = state.num_computed_tokens
            if start + 1 != len(state.token_ids) or start < state.num_prompt_tokens or start == 0:
                return None  # a prefill chunk (or a re-admitted request's first token)
            drafts = spec.get(req_id)
            n = len(drafts) if drafts else 0
            # max() runs in C: any draft id >= 0 is a scheduler-provided one (general layout)
            if count != 1 + n or count > threshold or (n and max(drafts) >= 0) \
                    or start + count > max_model_len:
                return None
            rows.append(state)
            counts.append(1 + n)
            num_drafts.append(n)
        m = len(rows)
        return rows, counts, num_drafts, [True] * m, [None] * m

    def _general_layout(self, scheduler_output: Any):
        """Decode rows first (their anchors and drafts come from the device state), then the
        prefill chunks (ids from the host history); validates every row against the state."""
        new_set = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        decode_rows, prefill_rows = [], []
        threshold = 1 + self.num_spec_tokens
        for r, count in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[r]
            # Decode rows (short queries of started requests) first: the builders' decode/prefill
            # split is by query length (reorder_batch_threshold).
            is_decode = (r not in new_set and state.num_computed_tokens > 0
                         and int(count) <= threshold)
            (decode_rows if is_decode else prefill_rows).append(state)
        rows = decode_rows + prefill_rows
        counts, num_drafts, samples, host_ids = [], [], [], []
        forced_rows = []
        for state in rows:
            req_id = state.req_id
            count = int(scheduler_output.num_scheduled_tokens[req_id])
            start = state.num_computed_tokens
            known = len(state.token_ids)
            drafts = list(scheduler_output.scheduled_spec_decode_tokens.get(req_id, []))
            if start + count > self.max_model_len:
                raise ValueError(f"request {req_id!r} would reach {start + count} tokens, past "
                                 f"max_model_len={self.max_model_len}")
            if start + 1 == known and start >= state.num_prompt_tokens:
                # decode: the anchor (last sampled token) plus drafts, all from device state
                if count != 1 + len(drafts):
                    raise ValueError(
                        f"request {req_id!r}: {count} tokens scheduled but 1 + {len(drafts)} "
                        "drafts given; num_scheduled_tokens must be 1 + len(drafts)")
                if drafts and any(d >= 0 for d in drafts):
                    forced_rows.append((state.slot, drafts))
                    self._has_draft_probs[state.slot] = False
                counts.append(count)
                num_drafts.append(len(drafts))
                samples.append(True)
                host_ids.append(None)
            else:
                if start + count > known:
                    raise ValueError(
                        f"request {req_id!r}: scheduler says {start} computed + {count} scheduled "
                        f"tokens but the runner holds {known} tokens")
                if drafts:
                    raise ValueError(f"request {req_id!r}: drafts scheduled for a prefill chunk")
                counts.append(count)
                num_drafts.append(0)
                samples.append(start + count == known)  # a prefill samples when it completes
                host_ids.append(state.token_ids[start:start + count])
        if forced_rows:
            # Scheduler-provided draft ids (tests, external drafters) replace the device drafts.
            for slot, drafts in forced_rows:
                self._forced.np[slot, :len(drafts)] = drafts
            self._forced.copy_to_gpu()
            widths = {len(d) for _, d in forced_rows}
            for w in widths:
                sel = [s for s, d in forced_rows if len(d) == w]
                idx = self._pinned_index(sel, f"forced{w}")
                self.requests.draft_tokens[idx, :w] = self._forced.gpu[idx, :w]
        return rows, counts, num_drafts, samples, host_ids

    # graph steps whose attention metadata was carried over from the previous graph step
    graph_step_advances = 0

    def _build_batch(self, layout, num_reqs_padded: int | None, cudagraph: bool,
                     advance: bool = True) -> InputBatch:
        rows, counts, num_drafts, samples, host_ids = layout
        q = max(counts)
        batch = self.batch_builder.build(
            rows, counts, num_drafts, samples, host_ids, self.requests, self.block_tables,
            num_reqs_padded=num_reqs_padded,
            num_tokens_padded=None if num_reqs_padded is None else num_reqs_padded * q)
        batch.cudagraph = cudagraph
        if cudagraph and advance and self._advance_graph_step(batch):
            return batch
        # One host copy serves both length arguments (exact lengths are their own upper bound;
        # the builders only read them).
        seq_lens_cpu = torch.from_numpy(batch.seq_lens_np.copy())
        batch.attn_metadata = build_attn_metadata(
            attn_metadata_builders=self.attn_metadata_builders,
            kv_cache_config=self.kv_cache_config,
            num_reqs=batch.num_reqs_padded,
            num_tokens=batch.num_tokens_padded,
            query_start_loc=batch.query_start_loc,
            query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens=batch.seq_lens,  # the [num_reqs_padded] view (no slice per step)
            max_query_len=q,
            # Graph replays keep the capture's bound (kernels shaped by it are baked in).
            max_seq_len=(self.max_model_len if cudagraph else
                         int(batch.seq_lens_np.max()) if batch.num_reqs else 0),
            block_tables=batch.block_tables,
            slot_mappings=batch.slot_mappings,
            causal=True,
            dcp_local_seq_lens=batch.dcp_local_seq_lens,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
            dcp_local_seq_lens_cpu=(None if batch.dcp_local_seq_lens_np is None
                                    else torch.from_numpy(batch.dcp_local_seq_lens_np.copy())),
            block_tables_cpu=self.block_tables.input_block_tables_cpu,
            num_blocks_cpu=self.block_tables.input_num_blocks_cpu,
            cudagraph=cudagraph,
            group_ids=self._target_group_ids,
        )
        if self._kv_write_only_groups:
            # Entries over the persistent slot-mapping buffer: one set per padded token count,
            # made once (the slot mappings are rewritten in place every step).
            entries = self._write_only_entries.get(batch.num_tokens_padded)
            if entries is None:
                entries = self._write_only_entries[batch.num_tokens_padded] = \
                    self._make_write_only_entries(batch.num_tokens_padded)
            batch.attn_metadata.update(entries)
        self._held_graph_step = None
        if cudagraph and advance and self._graph_step_advance:
            n = batch.num_reqs
            self._held_graph_step = ((batch.num_reqs_padded, batch.num_tokens_padded, n),
                                     batch.idx_mapping_np[:n].copy(), batch.attn_metadata)
        return batch

    def _advance_graph_step(self, batch: InputBatch) -> bool:
        """Give a graph step the previous graph step's attention metadata, advanced on the
        device, when its rows are the same slots with the same query rows (the batch
        builder has written this step's lengths into the device buffers that metadata
        aliases): each builder writes the new lengths from the device where its held state
        still fits them (advance_graph_metadata). Why: a graph replay reads no metadata on the
        host, and in steady decode the host build (the MLA geometry, the FlashInfer CSR, the
        plan refresh) was ~0.25 ms of a ~1 ms B=1 DSpark step on the H100 node (twenty-fifth
        session, probe_spec_step.py), run before the step's launch. False: build."""
        held = self._held_graph_step
        if held is None:
            return False
        shape, slots, attn_metadata = held
        n = batch.num_reqs
        if (shape != (batch.num_reqs_padded, batch.num_tokens_padded, n)
                or not np.array_equal(slots, batch.idx_mapping_np[:n])
                or not advance_graph_metadata(
                    attn_metadata_builders=self.attn_metadata_builders,
                    kv_cache_config=self.kv_cache_config, attn_metadata=attn_metadata,
                    seq_lens_np=batch.seq_lens_np, group_ids=self._target_group_ids)):
            return False
        batch.attn_metadata = attn_metadata
        self.graph_step_advances += 1
        return True

    def _make_write_only_entries(self, num_tokens: int) -> dict[str, KVWriteOnlyMetadata]:
        """{layer: metadata} of the KV-write-only groups (a block drafter's layers in the target
        step) for num_tokens padded tokens, over views of the persistent slot mappings."""
        groups = self.kv_cache_config.kv_cache_groups
        slot_mappings = self.block_tables.slot_mappings
        entries = {}
        for group_id in self._kv_write_only_groups:
            write_only = KVWriteOnlyMetadata(slot_mapping=slot_mappings[group_id, :num_tokens])
            for layer_name in groups[group_id].layer_names:
                entries[layer_name] = write_only
        return entries

    # ------------------------------------------------------------ memory profiling
    def profile_run(self, num_tokens: int | None = None, estimate_graphs: bool = False):
        """The worker's memory profile: a worst-case dummy step on a temporary KV cache, before
        initialize_kv_cache; leaves the runner as it was (memory_profile.py)."""
        from vllm.v1.worker.gpu.memory_profile import profile_run
        return profile_run(self, num_tokens, estimate_graphs=estimate_graphs)
