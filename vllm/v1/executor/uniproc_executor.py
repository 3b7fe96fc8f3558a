"""World size 1: the worker lives in the engine's process."""
from __future__ import annotations

from vllm.v1.executor.abstract import Executor, resolve_qualname


class UniProcExecutor(Executor):

    def _init_executor(self) -> None:
        if self.world_size != 1:
            raise ValueError(f"UniProcExecutor runs one rank, but tensor_parallel_size="
                             f"{self.world_size}; use MultiprocExecutor")
        self.worker = resolve_qualname(self.worker_cls)(self.vllm_config, 0, None)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None) -> list:
        if self.is_shutdown:
            raise RuntimeError("the executor is shut down; create a new engine")
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def supports_async_scheduling(self) -> bool:
        return hasattr(self.worker, "execute_model_async")

    def execute_model_async(self, scheduler_output):
        if self.is_shutdown:
            raise RuntimeError("the executor is shut down; create a new engine")
        return self.worker.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        if self.is_shutdown:
            return
        self.is_shutdown = True
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            worker.shutdown()
