"""One worker per rank: device + process groups, the model runner, and KV cache sizing.

Rank r of a TP x DCP world runs on `cuda:r` (NCCL) or on the CPU (gloo). Every rank runs the same
steps on the same scheduler output; only rank 0's ModelRunnerOutput goes back to the engine.
"""
from __future__ import annotations

import gc
import os

import torch

from vllm.v1.core.kv_cache_utils import num_virtual_blocks

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

    # ---- start-up ----------------------------------------------------------------------------
    def init_device(self) -> None:
        from vllm.distributed.parallel_state import (init_distributed_environment,
                                                     initialize_model_parallel)
        parallel = self.vllm_config.parallel_config
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
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
        torch.manual_seed(int(getattr(self.vllm_config.model_config, "seed", 0)))

    def load_model(self) -> None:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        self.model_runner = GPUModelRunner(self.vllm_config, self.device, self.rank)
        self.model_runner.load_model()

    # ---- KV cache ----------------------------------------------------------------------------
    def determine_num_available_blocks(self) -> int:
        """Blocks this rank can hold; the executor takes the minimum over ranks."""
        from vllm.v1.core.kv_cache_utils import get_num_blocks
        cache = self.vllm_config.cache_config
        override = getattr(cache, "num_gpu_blocks_override", None)
        if override is not None:
            return int(override)
        specs = self.model_runner.get_kv_cache_spec()
        budget = getattr(cache, "kv_cache_memory_bytes", None)
        if budget is None:
            if self.device.type == "cuda":
                budget = self._free_gpu_memory_budget()
            else:
                budget = _DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = int(get_num_blocks(max(budget, 0), specs, self._dcp_size()))
        if self.device.type == "cpu" and getattr(cache, "kv_cache_memory_bytes", None) is None:
            # Enough for max_num_seqs full-length requests is all a CPU run can use anyway.
            num_blocks = min(num_blocks, self._blocks_for_full_batch())
        return num_blocks

    def _free_gpu_memory_budget(self) -> int:
        torch.cuda.synchronize(self.device)
        # Memory cached by an earlier engine in this process would otherwise count as used.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        utilization = float(getattr(self.vllm_config.cache_config, "gpu_memory_utilization",
                                    _DEFAULT_GPU_MEMORY_UTILIZATION))
        budget = int(free - (1.0 - utilization) * total)
        if budget <= 0:
            raise ValueError(
                f"rank {self.rank}: no GPU memory left for the KV cache ({free / 2**30:.1f} GiB "
                f"free of {total / 2**30:.1f} GiB, {1 - utilization:.0%} kept in reserve); free "
                "the GPU (another engine alive?) or set kv_cache_memory_bytes / "
                "num_gpu_blocks_override")
        return budget

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
        self.model_runner.initialize_kv_cache(kv_cache_config)

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
                                                     destroy_model_parallel)
        self.model_runner = None
        try:
            destroy_model_parallel()
        finally:
            destroy_distributed_environment()
        if self.device.type == "cuda":
            # Hand the KV cache and weights back, for a later engine in this process.
            gc.collect()
            torch.cuda.empty_cache()
