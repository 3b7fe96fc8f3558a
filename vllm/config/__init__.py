"""Engine configuration dataclasses (validated on construction; errors name field, value, allowed)."""
from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.vllm import VllmConfig

__all__ = ["CacheConfig", "CompilationConfig", "LoadConfig", "ModelConfig", "ParallelConfig", "SpeculativeConfig", "VllmConfig"]
