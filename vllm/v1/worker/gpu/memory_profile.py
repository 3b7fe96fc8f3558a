"""The worker's GPU memory plan, measured as upstream vLLM does (`determine_available_memory`).

Before the KV cache exists the worker runs `profile_run`: one dummy step of the worst case a step
can be (one request prefilling `max_num_batched_tokens` new tokens after two passes' worth of
cached context, the LM head and the sampler on the step's logit rows) against a small temporary
KV cache, and records the growth of `torch.cuda.max_memory_allocated` over what was allocated
when the step began: the activation peak. The KV cache then gets

    gpu_memory_utilization * total - memory in use - activation peak - graph/buffer estimate

where "memory in use" is this process's torch allocation after the profile (weights + the
runner's persistent buffers) plus the non-torch memory it grew since the worker started (CUDA
libraries' workspaces, NCCL), and the graph/buffer estimate is what `initialize_kv_cache` adds
beyond the KV tensors (block tables, metadata builders' buffers, FlashInfer workspaces, CUDA
graph pools), measured on the temporary cache with the largest capture size only and
extrapolated to the other sizes by their static outputs.

Nothing of the profile stays allocated: the temporary KV cache, builders, block tables,
speculator and graphs are dropped (the runner's attributes are restored to what they were) and
the allocator's cache is emptied, so the real `initialize_kv_cache` runs exactly as without a
profile.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)
GiB = float(1 << 30)
# Context passes the dummy step reads: the second pass is the steady state of a long prefill
# (the LSE merge of a pass into the running result holds both; a lone pass merges nothing).
PROFILE_CONTEXT_PASSES = 2
PROFILE_REQ_ID = "_memory_profile"


def _gib(num_bytes: float | int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / GiB:.2f}"


# ------------------------------------------------------------------------------ the plan
@dataclass
class MemoryProfile:
    """One rank's memory plan (bytes). Filled in three stages: model load (weights), the
    profile run (activation peak, estimates, the KV budget), and `initialize_kv_cache`
    (what the KV cache and the graphs/buffers really took)."""

    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int = 0
    load_seconds: float = 0.0
    # The runner's persistent buffers made at its construction (input and request state).
    runner_buffer_bytes: int = 0
    # Torch allocation once the profile is over (weights + persistent runner buffers + any
    # cache a first step creates for good).
    torch_in_use_bytes: int = 0
    # What the profile run left allocated for good: the caches a process's first forward
    # creates and keeps (cuBLAS / cuBLASLt per-stream workspaces, 32 MiB a stream on Hopper,
    # allocated through torch's allocator). Zero when an earlier engine in this process
    # already made them.
    first_step_cache_bytes: int = 0
    # Non-torch device memory the process grew since the worker started (library workspaces,
    # NCCL buffers), after the profile.
    non_torch_bytes: int = 0
    activation_peak_bytes: int = 0
    profile_tokens: int = 0
    profile_context_tokens: int = 0
    profile_logit_rows: int = 0
    # initialize_kv_cache beyond the KV tensors (builders' buffers, block tables, workspaces,
    # CUDA graph pools), estimated on the profile's temporary cache.
    graph_buffer_estimate_bytes: int = 0
    # Device memory free after the profile: the KV cache can never be larger than this minus
    # the activation peak and the graphs/buffers (other processes may hold memory).
    free_bytes: int | None = None
    profile_seconds: float = 0.0
    # Set when the KV size is fixed by an option instead of the profile.
    fixed_kv_source: str | None = None
    fixed_kv_bytes: int | None = None
    # initialize_kv_cache, measured (None until it ran).
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None
    # initialize_kv_cache beyond the KV tensors (buffers, workspaces, CUDA graph pools)
    graph_buffer_bytes: int | None = None          # allocated growth
    graph_buffer_device_bytes: int | None = None   # device (mem_get_info) growth beyond them
    graph_capture_seconds: float | None = None
    graph_capture_bytes: int | None = None         # device memory the captures took
    num_graphs: int = 0
    kv_init_seconds: float | None = None

    # -------------------------------------------------------------------- arithmetic
    @property
    def requested_bytes(self) -> int:
        """What this instance may fill: gpu_memory_utilization * total."""
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def non_kv_cache_bytes(self) -> int:
        return int(self.torch_in_use_bytes + self.non_torch_bytes + self.activation_peak_bytes
                   + self.graph_buffer_estimate_bytes)

    @property
    def profiled_kv_budget_bytes(self) -> int:
        """util * total - in use - activation peak - graphs/buffers, capped by free memory."""
        budget = self.requested_bytes - self.non_kv_cache_bytes
        if self.free_bytes is not None:
            budget = min(budget, self.physical_room_bytes)
        return int(budget)

    @property
    def physical_room_bytes(self) -> int:
        free = self.free_bytes if self.free_bytes is not None else self.total_bytes
        return int(free - self.activation_peak_bytes - self.graph_buffer_estimate_bytes)

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.fixed_kv_bytes if self.fixed_kv_bytes is not None
                   else self.profiled_kv_budget_bytes)

    def check_kv_budget(self, rank: int = 0) -> int:
        """The profiled KV budget, or a clear error when it leaves no room."""
        budget = self.profiled_kv_budget_bytes
        if budget <= 0:
            raise ValueError(
                f"rank {rank}: no GPU memory left for the KV cache: gpu_memory_utilization "
                f"{self.gpu_memory_utilization:.2f} x {_gib(self.total_bytes)} GiB = "
                f"{_gib(self.requested_bytes)} GiB, minus in use {_gib(self.torch_in_use_bytes)} "
                f"GiB (weights {_gib(self.weights_bytes)}), non-torch "
                f"{_gib(self.non_torch_bytes)} GiB, activation peak "
                f"{_gib(self.activation_peak_bytes)} GiB ({self.profile_tokens}-token step), "
                f"CUDA graphs + buffers {_gib(self.graph_buffer_estimate_bytes)} GiB, free "
                f"{_gib(self.free_bytes)} GiB, leaves {_gib(budget)} GiB; raise "
                "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, pass "
                "--enforce-eager, free the GPU (another engine alive?) or set "
                "kv_cache_memory_bytes / num_gpu_blocks_override")
        return budget

    @property
    def planned_bytes(self) -> int | None:
        """weights + runner buffers + KV + activation peak + graphs/buffers as measured at
        start-up (None until initialize_kv_cache ran): what a step may hold at most by this
        plan (allocated bytes, the measure of torch.cuda.max_memory_allocated)."""
        if self.kv_cache_bytes is None or self.graph_buffer_bytes is None:
            return None
        return int(self.static_bytes + self.activation_peak_bytes)

    @property
    def static_bytes(self) -> int | None:
        """What the process holds between steps by this plan: weights + runner buffers +
        first-step caches + KV + graphs/buffers (None until initialize_kv_cache ran)."""
        if self.kv_cache_bytes is None or self.graph_buffer_bytes is None:
            return None
        return int(self.weights_bytes + self.runner_buffer_bytes + self.first_step_cache_bytes
                   + self.kv_cache_bytes + self.graph_buffer_bytes)

    # ------------------------------------------------------------------------ logging
    def profile_line(self) -> str:
        return (f"Memory profiling takes {self.profile_seconds:.2f} seconds. Total non KV cache "
                f"memory: {_gib(self.non_kv_cache_bytes)}GiB; torch peak memory increase: "
                f"{_gib(self.activation_peak_bytes)}GiB (activations of a "
                f"{self.profile_tokens}-token step after {self.profile_context_tokens} context "
                f"tokens, {self.profile_logit_rows} logit rows); non-torch forward increase "
                f"memory: {_gib(self.non_torch_bytes)}GiB; weights memory: "
                f"{_gib(self.weights_bytes)}GiB; first-step caches "
                f"{_gib(self.first_step_cache_bytes)}GiB (cuBLAS workspaces); CUDA graph + "
                f"runner buffer estimate: "
                f"{_gib(self.graph_buffer_estimate_bytes)}GiB")

    def kv_line(self) -> str:
        if self.fixed_kv_source is not None:
            return (f"Available KV cache memory: {_gib(self.kv_budget_bytes)} GiB (fixed by "
                    f"{self.fixed_kv_source}; the profile, CUDA graphs not estimated, would give "
                    f"{_gib(self.profiled_kv_budget_bytes)} GiB)")
        return f"Available KV cache memory: {_gib(self.kv_budget_bytes)} GiB"

    def load_line(self) -> str:
        return (f"Model loading took {self.weights_bytes / GiB:.4f} GiB and "
                f"{self.load_seconds:.2f} seconds")

    def kv_init_line(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks, {_gib(self.kv_cache_bytes)} GiB; runner "
                f"buffers + CUDA graphs took {_gib(self.graph_buffer_bytes)} GiB allocated "
                f"({_gib(self.graph_buffer_device_bytes)} GiB of device memory; estimated "
                f"{_gib(self.graph_buffer_estimate_bytes)} GiB)")

    def graph_line(self) -> str:
        return (f"Graph capturing finished in {self.graph_capture_seconds or 0:.0f} secs, took "
                f"{_gib(self.graph_capture_bytes)} GiB ({self.num_graphs} graphs)")

    def log(self) -> None:
        """Every start-up line (INFO) of the stages done so far."""
        for line in self.lines():
            logger.info(line)

    def lines(self) -> list[str]:
        out = [self.load_line()]
        if self.profile_tokens:
            out += [self.profile_line(), self.kv_line()]
        if self.kv_cache_bytes is not None:
            out.append(self.kv_init_line())
        if self.graph_capture_seconds is not None:
            out.append(self.graph_line())
        return out


# ------------------------------------------------------------------------ measurements
@dataclass
class DeviceMemory:
    """One reading of the device's memory (bytes)."""

    free: int
    total: int
    allocated: int
    reserved: int

    @property
    def non_torch(self) -> int:
        """Device memory in use that torch's allocator does not hold (this process's libraries
        and context, and other processes)."""
        return self.total - self.free - self.reserved

    @classmethod
    def read(cls, device: torch.device, empty_cache: bool = True) -> "DeviceMemory":
        torch.cuda.synchronize(device)
        if empty_cache:
            gc.collect()
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(int(free), int(total), int(torch.cuda.memory_allocated(device)),
                   int(torch.cuda.memory_reserved(device)))


@dataclass
class ProfileRunResult:
    """What `profile_run` measured (bytes; zeros on a CPU runner, which runs the same steps)."""

    num_tokens: int
    context_tokens: int
    num_logit_rows: int
    step_peak_bytes: int = 0       # the dummy prefill step over what was allocated before it
    sampler_peak_bytes: int = 0    # LM head + sampler on the logit rows (hidden alive)
    temp_kv_bytes: int = 0
    # The temporary initialize_kv_cache without its KV tensors: torch-reserved growth (live
    # buffers + graph pools) + the other capture sizes' outputs, and the allocated growth.
    graph_buffer_bytes: int = 0
    graph_buffer_allocated_bytes: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.step_peak_bytes, self.sampler_peak_bytes)


def profile_shape(runner: Any, num_tokens: int | None = None) -> tuple[int, int]:
    """(new tokens, cached context tokens) of the worst step: one request of
    `max_num_batched_tokens` tokens after PROFILE_CONTEXT_PASSES context passes on every rank,
    within max_model_len."""
    max_len = int(runner.max_model_len)
    budget = int(num_tokens if num_tokens is not None
                 else runner.vllm_config.max_num_batched_tokens)
    if budget < 1:
        raise ValueError(f"profile_run: num_tokens={budget} must be >= 1")
    new = min(budget, max_len)
    chunk = max([int(getattr(b, "prefill_context_chunk_tokens", 0) or 0)
                 for b in runner.attn_metadata_builders] or [0])
    want = PROFILE_CONTEXT_PASSES * chunk * int(runner.dcp_size)
    return new, max(0, min(want, max_len - new))


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _graph_output_bytes(manager: Any) -> int:
    """Bytes of the static outputs of the largest captured graph of `manager`."""
    step = manager.graphs.get(manager.max_size)
    if step is None:
        return 0
    return _tensor_bytes(step.outputs)


def _largest_only_managers(runner: Any) -> tuple[dict, Any, dict[int, list[int]]]:
    """Managers that capture only their largest size (for the estimate), and every manager's
    full size list (for the extrapolation)."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    managers, sizes = {}, {}
    for q, manager in runner._graph_managers.items():
        managers[q] = CudaGraphManager([manager.max_size], q, manager.device)
        sizes[q] = list(manager.capture_sizes)
    main = managers.get(runner.cudagraphs.query_len) if runner.cudagraphs is not None else None
    return managers, main, sizes


def _scheduler_outputs(runner: Any, num_tokens: int, context: int):
    from vllm.v1.core.kv_cache_utils import num_virtual_blocks
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    total = context + num_tokens
    lookahead = runner.num_spec_tokens + 1
    blocks = num_virtual_blocks(total + lookahead, runner.block_size, runner.dcp_size)
    # Block 0 is what CUDA-graph dummy batches point at: the request gets ids 1...
    block_ids = list(range(1, blocks + 1))
    prompt = [0] * total
    step = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(PROFILE_REQ_ID, prompt, block_ids, context, None)],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={PROFILE_REQ_ID: num_tokens},
        total_num_scheduled_tokens=num_tokens)
    finish = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                             finished_req_ids={PROFILE_REQ_ID})
    return step, finish, blocks + 1


def _sampler_run(runner: Any, num_tokens: int, rows: int) -> None:
    """LM head + sampler on `rows` logit rows (random sampling with top-k and top-p, the
    widest path) while a [num_tokens, hidden] hidden state is alive, as in a real step."""
    from vllm.v1.sample.metadata import SamplingMetadata
    device = runner.device
    hidden_size = int(runner.vllm_config.model_config.hf_config.hidden_size)
    dtype = next(runner.model.parameters()).dtype
    hidden = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
    logits = runner.model.compute_logits(hidden[:rows])
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), 0.7, dtype=torch.float32, device=device),
        all_greedy=False, all_random=True,
        top_k=torch.full((rows,), 20, dtype=torch.int64, device=device),
        top_p=torch.full((rows,), 0.9, dtype=torch.float32, device=device))
    runner.sampler(logits, metadata)
    del hidden, logits


class _Peak:
    """max_memory_allocated growth over the allocation at entry (0 on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.bytes = 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.cuda and exc[0] is None:
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device) - self._start)


def profile_run(runner: Any, num_tokens: int | None = None,
                estimate_graphs: bool = False) -> ProfileRunResult:
    """Run the worst-case dummy step on a temporary KV cache and leave `runner` as it was
    (the RNG streams too: the dummy sampling draws in a fork of them)."""
    device = runner.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _profile_run(runner, num_tokens, estimate_graphs)


@torch.inference_mode()
def _profile_run(runner: Any, num_tokens: int | None,
                 estimate_graphs: bool) -> ProfileRunResult:
    """The runner's own `initialize_kv_cache` builds the temporary state (so the builders, block
    tables, speculator and workspaces are the real ones, at a few blocks), and the step goes
    through `execute_model` (admission, the step, sampling, drafting, then the request is
    finished), so the measured step is the engine's. `estimate_graphs` also captures the largest
    CUDA-graph size of each manager on the temporary cache (otherwise no graph is captured)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config
    device = runner.device
    cuda = device.type == "cuda"
    if runner.kv_cache_config is not None:
        raise RuntimeError("profile_run() must run before initialize_kv_cache(): the runner "
                           "already holds a KV cache")
    start = time.perf_counter()
    saved = dict(runner.__dict__)
    saved_kv = dict(runner.kv_caches)
    saved_draft_probs = runner._has_draft_probs.copy()
    layers = runner._attention_layers()
    saved_layer_caches = {name: getattr(layer, "kv_cache", None) for name, layer in layers.items()}
    sizes: dict[int, list[int]] = {}
    if estimate_graphs and runner.cudagraphs is not None:
        runner._graph_managers, runner.cudagraphs, sizes = _largest_only_managers(runner)
    else:
        runner._graph_managers, runner.cudagraphs = {}, None
    try:
        before = DeviceMemory.read(device) if cuda else None
        # The temporary pool holds the dummy request at the default context chunk (the
        # builders that know the real one exist only once the pool does); a larger chunk set
        # on the builders is profiled with the context this pool holds.
        from vllm.v1.attention.backends.mla.prefill import DEFAULT_CONTEXT_CHUNK_TOKENS
        planned_new = min(int(num_tokens if num_tokens is not None
                              else runner.vllm_config.max_num_batched_tokens),
                          int(runner.max_model_len))
        planned_context = max(0, min(PROFILE_CONTEXT_PASSES * DEFAULT_CONTEXT_CHUNK_TOKENS
                                     * int(runner.dcp_size), int(runner.max_model_len) - planned_new))
        _, _, num_blocks = _scheduler_outputs(runner, planned_new, planned_context)
        specs = runner.get_kv_cache_spec()
        runner.initialize_kv_cache(get_kv_cache_config(specs, num_blocks=num_blocks,
                                                       dcp_size=runner.dcp_size))
        new, context = profile_shape(runner, num_tokens)
        context = min(context, planned_context)
        result = ProfileRunResult(new, context, min(int(runner.max_num_reqs), new))
        result.temp_kv_bytes = _tensor_bytes(runner.kv_caches.values())
        if cuda:
            after = DeviceMemory.read(device)
            result.graph_buffer_allocated_bytes = max(
                0, after.allocated - before.allocated - result.temp_kv_bytes)
            # Reserved after emptying the cache: live tensors plus the graphs' private pools
            # (non-torch growth, e.g. kernel modules loaded, is counted by the worker apart).
            device_growth = max(0, after.reserved - before.reserved - result.temp_kv_bytes)
            # The other capture sizes add their static outputs to the shared pool (their
            # intermediates reuse it): extrapolate from the largest graph's outputs per row.
            extra = 0
            captured = [(manager, sizes.get(q, [])) for q, manager in runner._graph_managers.items()]
            draft = getattr(runner.speculator, "cudagraphs", None)
            if draft is not None and runner.cudagraphs is not None:
                # The draft step is captured at the target's sizes.
                captured.append((draft, sizes.get(runner.cudagraphs.query_len, [])))
            for manager, all_sizes in captured:
                per_row = _graph_output_bytes(manager) / max(manager.max_size, 1)
                extra += int(per_row * sum(s for s in all_sizes if s != manager.max_size))
            result.graph_buffer_bytes = device_growth + extra
            result.extra["graph_extrapolated_bytes"] = extra
        step, finish, _ = _scheduler_outputs(runner, new, context)
        with _Peak(device) as peak:
            runner.execute_model(step)
        result.step_peak_bytes = peak.bytes
        runner.execute_model(finish)
        with _Peak(device) as peak:
            _sampler_run(runner, new, result.num_logit_rows)
        result.sampler_peak_bytes = peak.bytes
    finally:
        # Everything the temporary state added goes: the runner's attributes as they were
        # (containers the state filled in place are refilled), the layers' caches unbound.
        runner.__dict__.clear()
        runner.__dict__.update(saved)
        runner.kv_caches.clear()
        runner.kv_caches.update(saved_kv)
        runner._has_draft_probs[:] = saved_draft_probs
        for name, layer in layers.items():
            layer.kv_cache = saved_layer_caches[name]
        if cuda:
            torch.cuda.synchronize(device)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result.seconds = time.perf_counter() - start
    return result
