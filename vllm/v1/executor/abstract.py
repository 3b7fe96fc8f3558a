"""Executor interface: runs the same call on every rank's worker; rank 0's answer is the result."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

DEFAULT_WORKER_CLS = "vllm.v1.worker.gpu.worker.Worker"


def resolve_qualname(qualname: str):
    """'package.module.Name' -> the object (used for worker classes, also inside child processes)."""
    module_name, _, attr = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"worker class {qualname!r} must be a dotted path like "
                         f"{DEFAULT_WORKER_CLS!r}")
    return getattr(importlib.import_module(module_name), attr)


class WorkerError(RuntimeError):
    """A worker process raised, died or stopped answering; the executor is shut down."""

    def summary(self) -> str:
        """One line: the first line of the message plus, for a worker traceback, its last line
        (the exception itself)."""
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        if len(lines) <= 1:
            return lines[0] if lines else "worker failure"
        return f"{lines[0].rstrip(':')}: {lines[-1]}"


class StepError(RuntimeError):
    """Every rank raised the same way inside one `execute_model` and kept serving: the executor
    stays usable, so the engine may pin the failure on a request (LLMEngine's isolation)."""

    def summary(self) -> str:
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        return lines[-1] if lines else "step failure"


class Executor(ABC):

    def __init__(self, vllm_config, worker_cls: str = DEFAULT_WORKER_CLS):
        self.vllm_config = vllm_config
        self.worker_cls = worker_cls
        self.world_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.is_shutdown = False
        self._init_executor()

    @staticmethod
    def get_class(vllm_config) -> type[Executor]:
        """parallel_config.distributed_executor_backend (upstream names): None = uni for TP=1,
        else mp; external_launcher = this process is one torchrun rank."""
        parallel = vllm_config.parallel_config
        backend = getattr(parallel, "distributed_executor_backend", None)
        if backend is None:
            backend = "uni" if int(parallel.tensor_parallel_size) == 1 else "mp"
        if backend == "external_launcher":
            from vllm.v1.executor.external_launcher import ExternalLauncherExecutor
            return ExternalLauncherExecutor
        if backend == "uni":
            from vllm.v1.executor.uniproc_executor import UniProcExecutor
            return UniProcExecutor
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the worker(s): device, process groups, model loaded."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Call `method` on every worker; return the per-rank results (rank order)."""

    def determine_num_available_blocks(self) -> int:
        # Every rank must use the same block ids, so the smallest rank decides.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_kv_cache(self, num_blocks: int | None = None) -> int:
        """Agree on the block count across ranks, allocate the caches; return the count."""
        if num_blocks is None:
            num_blocks = self.determine_num_available_blocks()
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    def execute_model(self, scheduler_output):
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def supports_async_scheduling(self) -> bool:
        return False

    def execute_model_async(self, scheduler_output):
        """Launch a step and return its AsyncModelRunnerOutput without waiting for the sampled
        ids (async scheduling). Only the in-process executor overlaps steps; VllmConfig refuses
        async_scheduling for the others."""
        raise NotImplementedError(f"{type(self).__name__} does not support async scheduling; "
                                  "drop --async-scheduling")

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
