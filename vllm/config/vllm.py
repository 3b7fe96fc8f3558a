"""VllmConfig: every config of one engine, plus the checks that span several of them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm.config._checks import check_positive_int
from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.load import LoadConfig
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
    # Async scheduling (upstream's --async-scheduling): schedule and prepare step N+1 while the
    # GPU runs step N; the sampled ids of step N reach the scheduler one step later. None (the
    # default, as upstream): on wherever it is supported (TP=1 in-process) for plain decoding and
    # for DFlash/DSpark under a speculation policy, else off (resolve_async_scheduling). With a
    # drafter only the steps that verify no drafts and propose none overlap.
    async_scheduling: bool | None = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)

    def __post_init__(self):
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} is invalid: "
                             "pass True or False")
        # Remembered so that the engine can turn an automatic choice off for an executor or
        # worker that cannot overlap steps (an explicit True is refused there instead).
        self.async_scheduling_auto = self.async_scheduling is None
        if self.async_scheduling is None:
            self.async_scheduling = False  # resolve_async_scheduling decides, below
        elif not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} is invalid: pass True, "
                             "False or None (on where supported)")
        elif self.async_scheduling:
            reason = self._async_scheduling_unsupported()
            if reason is not None:
                raise ValueError(reason)
        block_size = self.cache_config.block_size
        interleave = self.parallel_config.cp_kv_cache_interleave_size
        if block_size % interleave != 0:
            raise ValueError(
                f"block_size={block_size} is invalid with cp_kv_cache_interleave_size={interleave}: "
                "block_size must be a multiple of the interleave size (DCP hands out runs of "
                "interleave tokens inside each block).")
        if not isinstance(self.compilation_config, CompilationConfig):
            self.compilation_config = CompilationConfig.from_any(self.compilation_config)
        if not isinstance(self.load_config, LoadConfig):
            raise ValueError(f"load_config={self.load_config!r} is invalid: pass a LoadConfig.")
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config)
        if self.speculative_config is not None:
            self.speculative_config.resolve_draft_parallelism(
                self.parallel_config.tensor_parallel_size,
                self.parallel_config.decode_context_parallel_size)
        self.resolve_speculative_config()
        self.resolve_async_scheduling()

    def resolve_async_scheduling(self) -> None:
        """The automatic choice (async_scheduling None; the engine calls this again once the
        drafter's method is known). On where supported for plain decoding, and for the block
        drafters (DFlash/DSpark) under a speculation policy (disable_by_batch_size set): the
        steps the policy leaves without drafts overlap, which on the H200 brought a DSpark
        engine whose drafts cannot pay to within 5 % of plain decoding at B=1 (eighth session,
        docs/performance.md). Off for EAGLE/MTP (their draft pass writes draft KV every step,
        so no step overlaps) and for drafting on every step (likewise)."""
        if not self.async_scheduling_auto:
            return
        spec = self.speculative_config
        overlaps = spec is None or (spec.uses_block_drafter
                                    and spec.disable_by_batch_size is not None)
        self.async_scheduling = overlaps and self._async_scheduling_unsupported() is None

    def _async_scheduling_unsupported(self) -> str | None:
        """Why async scheduling cannot run with this config (None: it can)."""
        parallel = self.parallel_config
        backend = parallel.distributed_executor_backend
        if parallel.tensor_parallel_size != 1 or backend not in (None, "uni"):
            return (f"async_scheduling overlaps steps inside the engine process only (the uni "
                    f"executor), but tensor_parallel_size={parallel.tensor_parallel_size} and "
                    f"distributed_executor_backend={backend!r}; drop --async-scheduling or run "
                    "TP=1 with the uni executor")
        return None

    def resolve_speculative_config(self) -> None:
        """Complete the speculative config from the drafter's config.json once directories are
        known (the engine calls this again after substituting the built-in tiny model):
        MTP without a model on a user target = the target's own next-n layers; `method` and
        `num_speculative_tokens` default from the draft config; an oversized k is refused."""
        spec = self.speculative_config
        target_dir = self.model_config.model
        if spec is None:
            return
        if spec.method == "mtp" and spec.model is None and target_dir is not None:
            # DeepSeek ships its MTP layer(s) inside the target checkpoint
            from vllm.transformers_utils.config import load_hf_config
            n = int(load_hf_config(target_dir).get("num_nextn_predict_layers", 0) or 0)
            if n < 1:
                raise ValueError(f"speculative method 'mtp' without a model uses the target's own next-n "
                                 f"layers, but {target_dir}/config.json has num_nextn_predict_layers={n}; "
                                 "set speculative_config.model to an MTP drafter directory")
            spec.model = target_dir
        if spec.model is None or not os.path.isfile(os.path.join(spec.model, "config.json")):
            if spec.method is None:
                raise ValueError(f"speculative_config has no method and {spec.model!r} holds no "
                                 "config.json to infer it from; set speculative_config.method")
            return  # resolved later (built-in tiny drafter) or refused at load (missing directory)
        from vllm.transformers_utils.config import load_hf_config
        spec.resolve_from_draft_config(load_hf_config(spec.model))

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative_config
        if spec is not None and spec.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is unresolved: call "
                             "resolve_speculative_config() once the drafter directory is known")
        return 0 if spec is None else spec.num_speculative_tokens
