"""EngineArgs: the flat set of user-facing engine options, their CLI flags (upstream names), and the
conversion to a validated VllmConfig."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from vllm.config import CacheConfig, CompilationConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    speculative_config: dict[str, Any] | str | None = None
    attention_backend: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    distributed_backend: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    compilation_config: dict[str, Any] | str | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_capture_sizes: list[int] | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags to `parser` (defaults = the dataclass defaults)."""
        d = EngineArgs()
        group = parser.add_argument_group("engine")
        group.add_argument("--model", type=str, default=d.model,
                           help="model directory (config.json + *.safetensors); default: the "
                                "built-in tiny model")
        group.add_argument("--tokenizer", type=str, default=d.tokenizer,
                           help="tokenizer directory; default: the model directory")
        group.add_argument("--dtype", type=str, default=d.dtype,
                           help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")
        group.add_argument("--seed", type=int, default=d.seed)
        group.add_argument("--max-model-len", type=int, default=d.max_model_len,
                           help="default: the model's max_position_embeddings")
        group.add_argument("--block-size", type=int, default=d.block_size,
                           help="tokens per KV cache block on each rank")
        group.add_argument("--kv-cache-memory-bytes", type=int, default=d.kv_cache_memory_bytes,
                           help="KV cache budget per rank in bytes")
        group.add_argument("--num-gpu-blocks-override", type=int,
                           default=d.num_gpu_blocks_override,
                           help="exact number of KV cache blocks (overrides the budget)")
        group.add_argument("-tp", "--tensor-parallel-size", type=int,
                           default=d.tensor_parallel_size)
        group.add_argument("-dcp", "--decode-context-parallel-size", type=int,
                           default=d.decode_context_parallel_size,
                           help="shard the KV cache over this many of the TP ranks")
        group.add_argument("--cp-kv-cache-interleave-size", type=int,
                           default=d.cp_kv_cache_interleave_size,
                           help="consecutive tokens stored on one DCP rank before moving on")
        group.add_argument("--speculative-config", type=str, default=d.speculative_config,
                           help='JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 4}\'')
        group.add_argument("--attention-backend", type=str, default=d.attention_backend,
                           help="auto, TORCH_MLA or FLASHINFER_MLA")
        group.add_argument("--device", type=str, default=d.device, help="auto, cpu or cuda")
        group.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        group.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                           help="token budget of one engine step (prefill chunks + decodes)")
        group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                           default=d.enable_chunked_prefill,
                           help="prefill prompts longer than --max-num-batched-tokens in chunks "
                                "(default on; --no-enable-chunked-prefill prefills prompts whole)")
        group.add_argument("--distributed-backend", type=str, default=d.distributed_backend,
                           help="torch.distributed backend: auto, gloo or nccl")
        group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                           help="fraction of GPU memory for weights, activations and KV cache")
        group.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                           help="never use CUDA graphs (every step runs eagerly)")
        group.add_argument("-O", "--compilation-config", type=str, default=d.compilation_config,
                           help='JSON, e.g. \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\'')
        group.add_argument("--max-cudagraph-capture-size", type=int,
                           default=d.max_cudagraph_capture_size,
                           help="largest batch captured in a CUDA graph (default: max_num_seqs)")
        group.add_argument("--cudagraph-capture-sizes", type=int, nargs="+",
                           default=d.cudagraph_capture_sizes,
                           help="batch sizes captured in CUDA graphs (default 1 2 4 8 16 ...)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Pick the EngineArgs fields out of a parsed namespace (other attributes are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def create_speculative_config(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str) and spec.strip().lower() in ("", "none", "null"):
            return None
        if isinstance(spec, (str, dict)):
            return SpeculativeConfig.from_json(spec)
        raise ValueError(f"speculative_config={spec!r} is invalid: pass a dict, a JSON string "
                         "or None.")

    def create_engine_config(self) -> VllmConfig:
        return VllmConfig(
            model_config=ModelConfig(model=self.model, dtype=self.dtype,
                                     max_model_len=self.max_model_len, seed=self.seed,
                                     attention_backend=self.attention_backend,
                                     device=self.device, tokenizer=self.tokenizer,
                                     enforce_eager=self.enforce_eager),
            cache_config=CacheConfig(block_size=self.block_size,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                decode_context_parallel_size=self.decode_context_parallel_size,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
                distributed_backend=self.distributed_backend),
            speculative_config=self.create_speculative_config(),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            compilation_config=self.create_compilation_config(),
        )

    def create_compilation_config(self) -> CompilationConfig:
        config = CompilationConfig.from_any(self.compilation_config)
        if self.cudagraph_capture_sizes is not None:
            config.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))
            config.__post_init__()
        if self.max_cudagraph_capture_size is not None:
            config.max_cudagraph_capture_size = self.max_cudagraph_capture_size
            config.__post_init__()
        return config
