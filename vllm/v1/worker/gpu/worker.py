"""One worker per rank: device + process groups, the model runner, and KV cache sizing.

Rank r of a TP x DCP world runs on `cuda:r` (NCCL) or on the CPU (gloo). Every rank runs the same
steps on the same scheduler output; only rank 0's ModelRunnerOutput goes back to the engine.

GPU memory is planned as upstream vLLM plans it (memory_profile.py): the weights' size at load,
then a profiled worst-case step before the KV cache exists, and the KV cache gets what
gpu_memory_utilization leaves after them and the CUDA graphs / runner buffers. The plan is
`worker.memory_profile` (None on CPU, whose KV cache has a fixed budget).
"""
from __future__ import annotations

import gc
import logging
import os
import time

import torch

from vllm.v1.core.kv_cache_utils import num_virtual_blocks
from vllm.v1.worker.gpu.memory_profile import DeviceMemory, MemoryProfile

logger = logging.getLogger(__name__)

# KV cache budget per CPU worker when the config names none (CPU runs are tests and demos).
_DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024
# Fraction of the GPU memory the process may fill (weights + activations + KV cache).
_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def resolve_device(vllm_config, rank: int) -> torch.device:
    device = str(getattr(vllm_config.model_config, "resolved_device", None) or "cpu")
    if device.startswith("cuda"):
        return torch.device("cuda", rank)
    return torch.device("cpu")


class Worker:

    def __init__(self, vllm_config, rank: int = 0, distributed_init_method: str | None = None):
        self.vllm_config = vllm_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.world_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.device = resolve_device(vllm_config, rank)
        self.model_runner = None
        # GPU: the memory plan, filled at load, profile and KV cache allocation.
        self.memory_profile: MemoryProfile | None = None
        self._init_memory: DeviceMemory | None = None

    # ---- start-up ----------------------------------------------------------------------------
    def init_device(self) -> None:
        from vllm.distributed.parallel_state import (init_distributed_environment,
                                                     initialize_model_parallel)
        parallel = self.vllm_config.parallel_config
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Baseline of the plan: the non-torch memory the process grows from here on
            # (NCCL, library workspaces) is charged to it, other processes' is not.
            self._init_memory = DeviceMemory.read(self.device)
            backend = "nccl"
        else:
            # Ranks share the host's cores; oversubscribing threads slows every rank down.
            if self.world_size > 1:
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            backend = "gloo"
        requested = getattr(parallel, "distributed_backend", "auto")
        if requested not in (None, "auto"):
            backend = requested
        init_distributed_environment(self.world_size, self.rank, backend=backend,
                                     init_method=self.distributed_init_method)
        initialize_model_parallel(parallel.tensor_parallel_size,
                                  getattr(parallel, "decode_context_parallel_size", 1))
        from vllm.distributed.parallel_state import get_world_group
        # What shutdown may tear down: the distributed state this worker set up, in this process.
        self._dist_owner = (os.getpid(), get_world_group())
        torch.manual_seed(int(getattr(self.vllm_config.model_config, "seed", 0)))

    def load_model(self) -> None:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        cuda = self.device.type == "cuda"
        start = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.model_runner = GPUModelRunner(self.vllm_config, self.device, self.rank)
        built = torch.cuda.memory_allocated(self.device) if cuda else 0
        t0 = time.perf_counter()
        self.model_runner.load_model()
        seconds = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize(self.device)
            total = torch.cuda.mem_get_info(self.device)[1]
            self.memory_profile = MemoryProfile(
                total_bytes=int(total), gpu_memory_utilization=self._gpu_memory_utilization(),
                weights_bytes=int(torch.cuda.memory_allocated(self.device) - built),
                load_seconds=seconds, runner_buffer_bytes=int(built - start))
            logger.info(self.memory_profile.load_line())

    def _gpu_memory_utilization(self) -> float:
        return float(getattr(self.vllm_config.cache_config, "gpu_memory_utilization",
                             _DEFAULT_GPU_MEMORY_UTILIZATION))

    # ---- KV cache ----------------------------------------------------------------------------
    def determine_num_available_blocks(self) -> int:
        """Blocks this rank can hold; the executor takes the minimum over ranks. On the GPU the
        memory is profiled first (also when an option fixes the KV size: the plan is logged and
        exposed as `memory_profile` either way)."""
        from vllm.v1.core.kv_cache_utils import get_num_blocks
        cache = self.vllm_config.cache_config
        override = getattr(cache, "num_gpu_blocks_override", None)
        fixed_bytes = getattr(cache, "kv_cache_memory_bytes", None)
        specs = self.model_runner.get_kv_cache_spec()
        if self.device.type == "cuda":
            fixed = None
            if override is not None:
                fixed = ("num_gpu_blocks_override", int(override) * self._bytes_per_block(specs))
            elif fixed_bytes is not None:
                fixed = ("kv_cache_memory_bytes", int(fixed_bytes))
            if self.model_runner.kv_cache_config is None:
                profile = self.profile_memory(fixed)
            else:  # asked again once the cache exists: the plan made before it stands
                profile = self.memory_profile
            if override is not None:
                return int(override)
            budget = profile.kv_budget_bytes
            return int(get_num_blocks(max(int(budget), 0), specs, self._dcp_size()))
        if override is not None:
            return int(override)
        budget = fixed_bytes if fixed_bytes is not None else _DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = int(get_num_blocks(max(budget, 0), specs, self._dcp_size()))
        if fixed_bytes is None:
            # Enough for max_num_seqs full-length requests is all a CPU run can use anyway.
            num_blocks = min(num_blocks, self._blocks_for_full_batch())
        return num_blocks

    def profile_memory(self, fixed: tuple[str, int] | None = None) -> MemoryProfile:
        """Profile the worst-case step (upstream's determine_available_memory) and fill the
        plan's KV budget. `fixed` = (option name, KV bytes) when an option sets the KV size:
        the step is still profiled (its peak is part of the plan), the graphs are not."""
        profile = self.memory_profile
        if profile is None:
            raise RuntimeError("profile_memory() runs on a GPU worker after load_model()")
        # Memory cached by an earlier engine in this process would otherwise count as used
        # (read() collects and empties the cache first).
        before = DeviceMemory.read(self.device).allocated
        run = self.model_runner.profile_run(estimate_graphs=fixed is None)
        after = DeviceMemory.read(self.device)
        baseline = self._init_memory.non_torch if self._init_memory is not None else 0
        profile.torch_in_use_bytes = after.allocated
        profile.first_step_cache_bytes = max(0, after.allocated - before)
        profile.non_torch_bytes = max(0, after.non_torch - baseline)
        profile.free_bytes = after.free
        profile.activation_peak_bytes = run.activation_peak_bytes
        profile.profile_tokens = run.num_tokens
        profile.profile_context_tokens = run.context_tokens
        profile.profile_logit_rows = run.num_logit_rows
        profile.graph_buffer_estimate_bytes = run.graph_buffer_bytes
        profile.profile_seconds = run.seconds
        logger.info(profile.profile_line())
        if fixed is not None:
            profile.fixed_kv_source, profile.fixed_kv_bytes = fixed
        else:
            profile.check_kv_budget(self.rank)
            if profile.profiled_kv_budget_bytes == profile.physical_room_bytes:
                logger.warning(
                    "rank %d: the KV cache is capped by the free device memory (%.2f GiB free; "
                    "%.2f GiB were held outside this worker's torch allocator when it started: "
                    "other processes?), not by gpu_memory_utilization=%.2f",
                    self.rank, after.free / 2**30, baseline / 2**30,
                    profile.gpu_memory_utilization)
        logger.info(profile.kv_line())
        return profile

    def _bytes_per_block(self, specs) -> int:
        """KV bytes of one block id over every layer (replicated layers: dcp_size pages)."""
        dcp = self._dcp_size()
        return int(sum(spec.page_size_bytes * spec.pages_per_block_id(dcp)
                       for spec in specs.values()))

    def _dcp_size(self) -> int:
        """DCP size the KV pool is priced for (a replicated draft group costs dcp_size pages
        per block id)."""
        return int(getattr(self.vllm_config.parallel_config, "decode_context_parallel_size", 1)
                   or 1)

    def _blocks_for_full_batch(self) -> int:
        cfg = self.vllm_config
        spec = cfg.speculative_config
        lookahead = (int(spec.num_speculative_tokens) if spec else 0) + 1
        dcp = int(getattr(cfg.parallel_config, "decode_context_parallel_size", 1) or 1)
        per_req = num_virtual_blocks(int(cfg.model_config.max_model_len) + lookahead,
                                     cfg.cache_config.block_size, dcp)
        return int(cfg.max_num_seqs) * per_req

    def initialize_kv_cache(self, num_blocks: int) -> None:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config
        specs = self.model_runner.get_kv_cache_spec()
        kv_cache_config = get_kv_cache_config(specs, num_blocks=num_blocks,
                                              dcp_size=self._dcp_size())
        cuda = self.device.type == "cuda"
        before = DeviceMemory.read(self.device) if cuda else None
        t0 = time.perf_counter()
        self.model_runner.initialize_kv_cache(kv_cache_config)
        if cuda:
            self._record_kv_init(before, time.perf_counter() - t0, num_blocks)

    def _record_kv_init(self, before: DeviceMemory, seconds: float, num_blocks: int) -> None:
        """What initialize_kv_cache took: the KV tensors, and the rest (buffers, workspaces,
        CUDA graph pools), allocated and on the device; the captures' own time and memory."""
        runner = self.model_runner
        after = DeviceMemory.read(self.device, empty_cache=False)
        kv = sum(t.numel() * t.element_size() for t in runner.kv_caches.values())
        profile = self.memory_profile
        profile.kv_cache_bytes = int(kv)
        profile.num_blocks = int(num_blocks)
        profile.kv_init_seconds = seconds
        profile.graph_buffer_bytes = int(max(0, after.allocated - before.allocated - kv))
        profile.graph_buffer_device_bytes = int(max(0, before.free - after.free - kv))
        managers = list(getattr(runner, "_graph_managers", {}).values())
        draft = getattr(getattr(runner, "speculator", None), "cudagraphs", None)
        if draft is not None and draft not in managers:
            managers.append(draft)
        managers = [m for m in managers if getattr(m, "capture_seconds", None) is not None]
        if managers:
            profile.graph_capture_seconds = float(sum(m.capture_seconds for m in managers))
            profile.graph_capture_bytes = int(sum(m.capture_bytes for m in managers))
            profile.num_graphs = int(sum(len(m.graphs) for m in managers))
        logger.info(profile.kv_init_line())
        if profile.graph_capture_seconds is not None:
            logger.info(profile.graph_line())

    # ---- steps -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output):
        output = self.model_runner.execute_model(scheduler_output)
        return output if self.rank == 0 else None

    def execute_model_async(self, scheduler_output):
        """Async scheduling: the launched step's AsyncModelRunnerOutput (collect with
        get_output(), in launch order)."""
        return self.model_runner.execute_model_async(scheduler_output)

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        from vllm.distributed.parallel_state import (destroy_distributed_environment,
                                                     destroy_model_parallel, get_world_group)
        self.model_runner = None
        # Only the state this worker made, and only in its own process: a worker shut down late
        # (an engine collected by the garbage collector, or inherited by a forked child and
        # finalised there) must not destroy the process groups of whoever runs now.
        owner = getattr(self, "_dist_owner", None)
        if owner is not None and owner[0] == os.getpid() and get_world_group() is owner[1]:
            try:
                destroy_model_parallel()
            finally:
                destroy_distributed_environment()
        if self.device.type == "cuda":
            # Hand the KV cache and weights back, for a later engine in this process.
            gc.collect()
            torch.cuda.empty_cache()
