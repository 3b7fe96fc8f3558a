"""VllmConfig: every config of one engine, plus the checks that span several of them."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config._checks import check_positive_int
from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.speculative import SpeculativeConfig


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    # Chunked prefill (vLLM V1 default): a prompt longer than the per-step token budget
    # (max_num_batched_tokens) is prefilled over several steps; off = whole-prompt prefill.
    enable_chunked_prefill: bool = True
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self):
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} is invalid: "
                             "pass True or False")
        block_size = self.cache_config.block_size
        interleave = self.parallel_config.cp_kv_cache_interleave_size
        if block_size % interleave != 0:
            raise ValueError(
                f"block_size={block_size} is invalid with cp_kv_cache_interleave_size={interleave}: "
                "block_size must be a multiple of the interleave size (DCP hands out runs of "
                "interleave tokens inside each block).")
        if not isinstance(self.compilation_config, CompilationConfig):
            self.compilation_config = CompilationConfig.from_any(self.compilation_config)
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens
