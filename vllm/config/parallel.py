"""ParallelConfig: tensor parallelism and the decode-context-parallel (DCP) split of the KV cache."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config._checks import check_choice, check_positive_int

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
# Upstream names: mp = one worker process per rank on this host, uni = in-process (TP=1),
# external_launcher = every process was started by torchrun and is one rank (multi-node).
EXECUTOR_BACKENDS = ("mp", "uni", "external_launcher")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1  # DCP reuses TP ranks: consecutive blocks of TP ranks
    cp_kv_cache_interleave_size: int = 1  # tokens per run handed to one DCP rank
    distributed_backend: str = "auto"  # torch.distributed backend: auto = nccl on CUDA, else gloo
    distributed_executor_backend: str | None = None  # None = uni for TP=1, else mp

    def __post_init__(self):
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        check_positive_int("decode_context_parallel_size", self.decode_context_parallel_size)
        check_positive_int("cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size)
        if self.tensor_parallel_size % self.decode_context_parallel_size != 0:
            raise ValueError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} is invalid with "
                f"tensor_parallel_size={self.tensor_parallel_size}: DCP reuses the TP ranks, so "
                "tensor_parallel_size must be a multiple of decode_context_parallel_size.")
        self.distributed_backend = check_choice("distributed_backend", self.distributed_backend,
                                                DISTRIBUTED_BACKENDS)
        backend = self.distributed_executor_backend
        if backend is not None:
            if backend == "ray":
                raise ValueError("distributed_executor_backend='ray' is not supported: Ray is not "
                                 "available here; use mp on one host or external_launcher "
                                 "(torchrun) across hosts.")
            self.distributed_executor_backend = check_choice(
                "distributed_executor_backend", backend, EXECUTOR_BACKENDS)
            if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
                raise ValueError(f"distributed_executor_backend='uni' runs one process, but "
                                 f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp' "
                                 "or 'external_launcher'.")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp_size(self) -> int:
        return self.decode_context_parallel_size
