"""CacheConfig: paged KV cache geometry and size."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.config._checks import check_choice, check_positive_int

_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per physical block on each rank
    cache_dtype: str = "auto"  # auto = the model dtype
    kv_cache_memory_bytes: int | None = None  # per-rank budget; None = the runner's default
    num_gpu_blocks_override: int | None = None  # exact block count; wins over the budget
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may fill

    def __post_init__(self):
        check_positive_int("block_size", self.block_size)
        self.cache_dtype = check_choice("cache_dtype", self.cache_dtype, ["auto", *_CACHE_DTYPES])
        check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, optional=True)
        check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, optional=True)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < float(u) <= 1.0:
            raise ValueError(f"gpu_memory_utilization={u!r} is invalid: it must be a float in (0, 1].")
        self.gpu_memory_utilization = float(u)

    def resolve_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.cache_dtype == "auto" else _CACHE_DTYPES[self.cache_dtype]
