"""EngineArgs: the flat set of user-facing engine options, their CLI flags and the conversion to a
validated VllmConfig.

The flags are generated from the EngineArgs dataclass by introspection (as upstream does): the
flag name is the field name with dashes, the type comes from the annotation, defaults come from
the config dataclasses (`CacheConfig.block_size`, ...), and help / short aliases / choices live
in the field's metadata. Nothing is listed twice. Options this engine cannot honour are refused
in `create_engine_config` with one line naming the option and why.

Dict-valued options (`--speculative-config`, `--compilation-config`) take JSON or dotted keys,
`--speculative-config.method dspark --speculative-config.num_speculative_tokens 4`, merged by
`expand_dotted_args` before argparse sees them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from vllm.config import (CacheConfig, CompilationConfig, LoadConfig, ModelConfig,
                         ParallelConfig, SpeculativeConfig, VllmConfig)

from vllm.config.parallel import EXECUTOR_BACKENDS


def _opt(default=MISSING, help: str = "", *, aliases: tuple[str, ...] = (), choices=None,
         parse=None, nargs=None, json_dict: bool = False, default_factory=MISSING):
    """A dataclass field that also describes its CLI flag."""
    meta = {"help": help, "aliases": aliases, "choices": choices, "parse": parse, "nargs": nargs,
            "json_dict": json_dict}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---- value parsers (argparse `type=`) -----------------------------------------------------------
_SUFFIX = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """'32k' -> 32000, '32K' -> 32768, '25.6k' -> 25600, '4096' -> 4096 (upstream's rules:
    lower-case suffixes are decimal, upper-case ones binary and integer-only)."""
    text = str(value).strip()
    match = _SUFFIX.fullmatch(text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"{text!r}: decimals are not allowed with binary suffixes like {suffix}; did you "
                f"mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 4096, 32k, 32K)") from None


def human_readable_int_or_auto(value: str) -> int | None:
    """As human_readable_int; 'auto' and -1 mean the model's maximum (None)."""
    if str(value).strip().lower() == "auto":
        return None
    parsed = human_readable_int(value)
    return None if parsed == -1 else parsed


@dataclass
class EngineArgs:
    # ---- model (ModelConfig) ----
    model: str | None = _opt(ModelConfig.model, "model directory (config.json + *.safetensors); "
                             "default: the built-in tiny model")
    served_model_name: list[str] | str | None = _opt(
        None, "name(s) clients pass as `model`; the first is reported (default: the model "
        "directory name)", nargs="+")
    tokenizer: str | None = _opt(ModelConfig.tokenizer, "tokenizer directory; default: the model "
                                 "directory")
    dtype: str = _opt(ModelConfig.dtype, "auto (bfloat16 on CUDA, float32 on CPU), bfloat16, "
                      "float16, float32")
    seed: int = _opt(ModelConfig.seed, "engine seed (requests without a seed derive theirs)")
    max_model_len: int | None = _opt(
        None, "context length (prompt + output); accepts 4096, 32k (=32000), 32K (=32768), or "
        "auto / -1 = the model's max_position_embeddings", parse=human_readable_int_or_auto)
    attention_backend: str = _opt(ModelConfig.attention_backend, "auto, TORCH_MLA or FLASHINFER_MLA")
    device: str = _opt(ModelConfig.device, "auto, cpu or cuda")
    enforce_eager: bool = _opt(ModelConfig.enforce_eager, "never use CUDA graphs (every step runs "
                               "eagerly)")
    # ---- KV cache (CacheConfig) ----
    block_size: int = _opt(CacheConfig.block_size, "tokens per KV cache block on each rank")
    kv_cache_dtype: str = _opt(CacheConfig.cache_dtype, "KV cache dtype: auto (= the model "
                               "dtype; the only value this engine supports)")
    gpu_memory_utilization: float = _opt(CacheConfig.gpu_memory_utilization,
                                         "fraction of GPU memory for weights, activations and KV "
                                         "cache")
    kv_cache_memory_bytes: int | None = _opt(CacheConfig.kv_cache_memory_bytes,
                                             "KV cache budget per rank in bytes (overrides "
                                             "--gpu-memory-utilization)", parse=human_readable_int)
    num_gpu_blocks_override: int | None = _opt(CacheConfig.num_gpu_blocks_override,
                                               "exact number of KV cache blocks (overrides the "
                                               "budget)")
    enable_prefix_caching: bool | None = _opt(None, "prefix caching: not supported by this engine "
                                              "(--no-enable-prefix-caching is accepted)")
    # ---- parallelism (ParallelConfig) ----
    tensor_parallel_size: int = _opt(ParallelConfig.tensor_parallel_size, "TP ranks",
                                     aliases=("-tp",))
    decode_context_parallel_size: int = _opt(ParallelConfig.decode_context_parallel_size,
                                             "shard the KV cache over this many of the TP ranks",
                                             aliases=("-dcp",))
    cp_kv_cache_interleave_size: int = _opt(
        ParallelConfig.cp_kv_cache_interleave_size, "consecutive tokens stored on one DCP rank "
        "before moving on", aliases=("--dcp-kv-cache-interleave-size",))
    pipeline_parallel_size: int = _opt(1, "pipeline stages: only 1 is supported",
                                       aliases=("-pp",))
    data_parallel_size: int = _opt(1, "data-parallel replicas: only 1 is supported (run several "
                                   "servers)", aliases=("-dp",))
    distributed_executor_backend: str | None = _opt(
        ParallelConfig.distributed_executor_backend, "mp (one process per rank on this host), "
        "uni (single process, TP=1) or external_launcher (each torchrun process is one rank, "
        "e.g. across nodes); default: uni for TP=1, else mp", choices=EXECUTOR_BACKENDS)
    distributed_backend: str = _opt(ParallelConfig.distributed_backend,
                                    "torch.distributed backend: auto, gloo or nccl")
    # ---- scheduler ----
    max_num_seqs: int = _opt(VllmConfig.max_num_seqs, "most requests in one batch")
    max_num_batched_tokens: int = _opt(VllmConfig.max_num_batched_tokens,
                                       "most tokens in one step", parse=human_readable_int)
    enable_chunked_prefill: bool = _opt(
        VllmConfig.enable_chunked_prefill, "prefill prompts longer than --max-num-batched-tokens "
        "in chunks (default on, as vLLM V1; --no-enable-chunked-prefill prefills prompts whole)")
    async_scheduling: bool | None = _opt(
        VllmConfig.async_scheduling, "schedule and prepare step N+1 while the GPU runs step N "
        "(as upstream's --async-scheduling). Default: on wherever supported (TP=1) for plain "
        "decoding and for DFlash/DSpark under disable_by_batch_size, off elsewhere; "
        "--async-scheduling where unsupported is an error")
    # ---- speculative decoding / compilation ----
    speculative_config: dict[str, Any] | str | None = _opt(
        None, 'JSON, e.g. \'{"method": "dspark", "model": DIR, "num_speculative_tokens": 4}\', or '
        "dotted keys: --speculative-config.method dspark", json_dict=True)
    compilation_config: dict[str, Any] | str | None = _opt(
        None, 'JSON, e.g. \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\', or dotted keys',
        aliases=("-O",), json_dict=True)
    max_cudagraph_capture_size: int | None = _opt(None, "largest batch captured in a CUDA graph "
                                                  "(default: max_num_seqs)")
    cudagraph_capture_sizes: list[int] | None = _opt(None, "batch sizes captured in CUDA graphs "
                                                     "(default 1 2 4 8 16 ...)", nargs="+")
    # ---- checkpoints, quantisation, tokenizer ----
    quantization: str | None = _opt(None, "weight quantisation: fp8 (block 128x128; default: the "
                                    "checkpoint's quantization_config)", aliases=("-q",))
    load_format: str = _opt("auto", "auto / safetensors (read the checkpoint) or dummy (seeded "
                            "random weights of the config's shapes)")
    trust_remote_code: bool = _opt(False, "allow the tokenizer directory's own Python code "
                                   "(e.g. Kimi's)")
    chat_template: str | None = _opt(None, "chat template file (Jinja) overriding the "
                                     "tokenizer's")

    # ---- flags -----------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field, generated from the annotations (defaults = the field defaults)."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            names = [*[a for a in meta.get("aliases", ()) if a.startswith("-")
                       and not a.startswith("--")], flag,
                     *[a for a in meta.get("aliases", ()) if a.startswith("--")]]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default,
                                      "help": meta.get("help", "")}
            base, is_list = _base_type(hints[f.name])
            if meta.get("json_dict"):
                kwargs["type"] = str
            elif base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta.get("parse") or base
                if is_list or meta.get("nargs"):
                    kwargs["nargs"] = meta.get("nargs") or "+"
                if meta.get("choices"):
                    kwargs["choices"] = meta["choices"]
            group.add_argument(*names, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Pick the EngineArgs fields out of a parsed namespace (other attributes are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # ---- config ----------------------------------------------------------------------------
    def _refuse_unsupported(self) -> None:
        if str(self.kv_cache_dtype).lower() != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} (--kv-cache-dtype) is not "
                             "supported: the MLA KV cache is kept in the model dtype (set --dtype "
                             "to change it); use auto.")
        if self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching=True (--enable-prefix-caching) is not "
                             "supported: this engine has no prefix cache; drop the flag or pass "
                             "--no-enable-prefix-caching.")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} (-pp) is not "
                             "supported: this engine shards with TP x DCP only; use -tp.")
        if self.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} (-dp) is not "
                             "supported: run one server per replica.")

    def served_model_names(self) -> list[str]:
        names = self.served_model_name
        if names is None:
            return []
        return [names] if isinstance(names, str) else list(names)

    def create_speculative_config(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str) and spec.strip().lower() in ("", "none", "null"):
            return None
        if isinstance(spec, dict):
            spec = dict(spec)
            draft_tp = spec.pop("draft_tensor_parallel_size", None)
            _check_draft_tp(draft_tp, self.tensor_parallel_size)
            return SpeculativeConfig.from_json(spec)
        if isinstance(spec, str):
            return self._with_dict(spec)
        raise ValueError(f"speculative_config={spec!r} is invalid: pass a dict, a JSON string "
                         "or None.")

    def _with_dict(self, text: str) -> SpeculativeConfig | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return SpeculativeConfig.from_json(text)  # its error names the JSON problem
        if not isinstance(value, dict):
            return SpeculativeConfig.from_json(value)
        self.speculative_config = value
        return self.create_speculative_config()

    def _check_max_model_len(self, model_config: ModelConfig) -> None:
        """Upstream refuses a max_model_len above the model's max_position_embeddings (unless
        VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): positions past it were never trained."""
        requested = self.max_model_len
        if requested is None or model_config.model is None:
            return
        try:
            derived = int(model_config.hf_config.max_position_embeddings)
        except (OSError, AttributeError, ValueError):
            return  # the loader reports an unreadable model directory itself
        if requested > derived and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") != "1":
            raise ValueError(
                f"max_model_len={requested} (--max-model-len) is greater than the model's "
                f"max_position_embeddings={derived}; lower it (or pass auto), or set "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway.")

    def create_engine_config(self) -> VllmConfig:
        self._refuse_unsupported()
        model_config = ModelConfig(model=self.model, dtype=self.dtype,
                                   max_model_len=self.max_model_len, seed=self.seed,
                                   attention_backend=self.attention_backend,
                                   device=self.device, tokenizer=self.tokenizer,
                                   enforce_eager=self.enforce_eager,
                                   quantization=self.quantization,
                                   trust_remote_code=self.trust_remote_code,
                                   chat_template=self.chat_template)
        self._check_max_model_len(model_config)
        config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size,
                                     cache_dtype=self.kv_cache_dtype,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                decode_context_parallel_size=self.decode_context_parallel_size,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
                distributed_backend=self.distributed_backend,
                distributed_executor_backend=self.distributed_executor_backend),
            speculative_config=self.create_speculative_config(),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            async_scheduling=self.async_scheduling,
            compilation_config=self.create_compilation_config(),
            load_config=LoadConfig(load_format=self.load_format),
        )
        return config

    def create_compilation_config(self) -> CompilationConfig:
        value = self.compilation_config
        if isinstance(value, str) and value.strip().isdigit():
            raise ValueError(f"compilation_config={value!r} (-O{value}): optimisation levels are "
                             "not supported; pass JSON such as "
                             '\'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\'.')
        config = CompilationConfig.from_any(value)
        if self.cudagraph_capture_sizes is not None:
            config.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))
            config.__post_init__()
        if self.max_cudagraph_capture_size is not None:
            config.max_cudagraph_capture_size = self.max_cudagraph_capture_size
            config.__post_init__()
        return config


def _check_draft_tp(value, target_tp: int) -> None:
    if value is None or value == target_tp:
        return
    raise ValueError(f"--speculative-config key 'draft_tensor_parallel_size'={value!r} is not "
                     f"supported: the drafter runs on the target's {target_tp} TP rank(s) "
                     "(decoupled draft TP is not supported yet); drop the key or set it to "
                     f"{target_tp}.")


def _base_type(hint) -> tuple[type, bool]:
    """(element type, is a list) of an annotation like `int | None` or `list[int] | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for arg in args:
        if typing.get_origin(arg) is list:
            return typing.get_args(arg)[0], True
    for arg in args:
        if arg in (bool, int, float, str):
            return arg, False
    return str, False


# ---- dotted dict flags ---------------------------------------------------------------------------
def json_dict_flags() -> dict[str, str]:
    """flag spelling -> canonical flag, for the JSON-dict options (incl. aliases like -O)."""
    out = {}
    for f in fields(EngineArgs):
        if f.metadata.get("json_dict"):
            canonical = "--" + f.name.replace("_", "-")
            for name in (canonical, *f.metadata.get("aliases", ())):
                out[name] = canonical
    return out


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # bare strings: --speculative-config.method dspark


def expand_dotted_args(argv: list[str]) -> list[str]:
    """Turn `--speculative-config.key value` / `--speculative-config.key=value` (nested keys with
    more dots) into one `--speculative-config JSON`, merged over a JSON value given as well."""
    flags = json_dict_flags()
    dotted: dict[str, dict] = {}
    explicit: dict[str, Any] = {}
    out: list[str] = []
    first_pos: dict[str, int] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        head, eq, inline = token.partition("=")
        base, dot, path = head.partition(".")
        if dot and base in flags:
            canonical = flags[base]
            if eq:
                raw = inline
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{head} needs a value, e.g. {head} 4")
                raw = argv[i + 1]
                i += 1
            node = dotted.setdefault(canonical, {})
            keys = path.split(".")
            if not all(keys):
                raise ValueError(f"{head}: empty key in the dotted flag; write e.g. "
                                 f"{base}.method dspark")
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = _parse_value(raw)
            first_pos.setdefault(canonical, len(out))
            out.append(None)  # placeholder
        elif head in flags and (eq or i + 1 < len(argv)):
            canonical = flags[head]
            raw = inline if eq else argv[i + 1]
            if not eq:
                i += 1
            explicit[canonical] = raw
            first_pos.setdefault(canonical, len(out))
            out.append(None)
        else:
            out.append(token)
        i += 1
    result: list[str] = []
    emitted = set()
    positions = {pos: flag for flag, pos in first_pos.items()}
    for pos, token in enumerate(out):
        if token is not None:
            result.append(token)
            continue
        flag = positions.get(pos)
        if flag is None or flag in emitted:
            continue
        emitted.add(flag)
        raw = explicit.get(flag)
        if flag not in dotted:
            result += [flag, raw]
            continue
        base_value: Any = {}
        if raw is not None:
            try:
                base_value = json.loads(raw)
            except json.JSONDecodeError as error:
                raise ValueError(f"{flag} is not valid JSON: {error.msg} at column {error.colno} "
                                 f"of {raw!r}") from None
            if not isinstance(base_value, dict):
                raise ValueError(f"{flag} must be a JSON object to combine with dotted keys, got "
                                 f"{raw!r}")
        result += [flag, json.dumps(_merge(base_value, dotted[flag]))]
    return result


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
