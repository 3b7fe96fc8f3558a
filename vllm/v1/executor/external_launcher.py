"""distributed_executor_backend="external_launcher" (upstream name): the processes were started
by an external launcher (torchrun), one process per rank, possibly on several nodes.

Every process runs its own LLM / engine and drives only its own rank's worker; torch.distributed
is joined through torchrun's rendezvous (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
As upstream requires, every process must be given the same requests in the same order: the
schedulers then make identical decisions and the per-request generators (seeded identically)
draw identical tokens, so the ranks stay in lock-step without a driver process. Each process
gets the full outputs (rank 0 is not special).
"""
from __future__ import annotations

import os

import torch

from vllm.v1.executor.abstract import resolve_qualname
from vllm.v1.executor.uniproc_executor import UniProcExecutor

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ExternalLauncherExecutor(UniProcExecutor):
    """One in-process worker per torchrun process (UniProc's calls and shutdown), joined to the
    other ranks through torchrun's rendezvous."""

    def _init_executor(self) -> None:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' needs the torchrun "
                             f"environment ({', '.join(missing)} unset); start every rank with "
                             "`torchrun --nnodes N --nproc-per-node G ... script.py`")
        world = int(os.environ["WORLD_SIZE"])
        if world != self.world_size:
            raise ValueError(f"torchrun started WORLD_SIZE={world} processes but "
                             f"tensor_parallel_size={self.world_size}; each process is one TP rank, "
                             "so launch exactly tensor_parallel_size processes in total")
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        worker = resolve_qualname(self.worker_cls)(self.vllm_config, self.rank, "env://")
        if worker.device.type == "cuda":
            # The global rank indexes GPUs across nodes; this node's GPU is the local rank.
            worker.device = torch.device("cuda", self.local_rank)
        worker.init_device()
        worker.load_model()
        self.worker = worker

    def determine_num_available_blocks(self) -> int:
        # Every rank must use the same block count: the minimum over all ranks.
        import torch.distributed as dist
        local = int(self.worker.determine_num_available_blocks())
        device = self.worker.device if dist.get_backend() == "nccl" else torch.device("cpu")
        value = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())  # start-up only, not a step

    def supports_async_scheduling(self) -> bool:
        return False  # every torchrun process schedules alone, in lock-step with the others

    def execute_model(self, scheduler_output):
        # Every process needs the output (each runs its own engine), not only rank 0.
        return self.worker.model_runner.execute_model(scheduler_output)
