"""ParallelConfig: tensor parallelism and the decode-context-parallel (DCP) split of the KV cache."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.config._checks import check_choice, check_positive_int

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1  # DCP reuses TP ranks: consecutive blocks of TP ranks
    cp_kv_cache_interleave_size: int = 1  # tokens per run handed to one DCP rank
    distributed_backend: str = "auto"  # torch.distributed backend: auto = nccl on CUDA, else gloo

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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp_size(self) -> int:
        return self.decode_context_parallel_size
