"""From command-line flags to a validated VllmConfig, shared by serve / generate / bench.

* MODEL_DIR is positional (upstream's `vllm serve MODEL`); with no model the built-in tiny model is
  written (cached) and, unless --speculative-config says otherwise, served with its DSpark drafter.
* Everything the user could have got wrong is checked here, before any weights are loaded, and
  reported as one ValueError naming the flag: unknown/incomplete model directory, malformed
  --speculative-config JSON, tp % dcp, interleave with FlashInfer DCP on Blackwell, a non-causal
  draft on a backend that cannot run it under DCP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vllm.entrypoints.cli.errors import CLIError

DEFAULT_SPECULATOR = "dspark"


def add_model_and_engine_args(parser: argparse.ArgumentParser, model_help: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL_DIR", help=model_help)
    EngineArgs.add_cli_args(parser)


def check_model_dir(path: str, flag: str = "MODEL_DIR") -> str:
    if not os.path.exists(path):
        raise CLIError(f"{flag} {path!r} does not exist; pass a local model directory containing "
                       "config.json (run `vllm tiny-model` for a built-in one; no hub downloads)")
    if not os.path.isdir(path):
        raise CLIError(f"{flag} {path!r} is not a directory; pass the model directory that holds "
                       "config.json")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CLIError(f"{flag} {path!r} has no config.json; it is not a model directory")
    return os.path.abspath(path)


def parse_speculative_config(raw: Any) -> dict[str, Any] | None:
    """The --speculative-config value as a dict; one-line error naming the JSON problem."""
    if raw is None or isinstance(raw, dict):
        return raw
    if hasattr(raw, "method"):  # already a SpeculativeConfig
        return None
    text = str(raw).strip()
    if text == "" or text.lower() in ("none", "null"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise CLIError(f"--speculative-config is not valid JSON: {error.msg} at line {error.lineno} "
                       f"column {error.colno} of {text!r}; write e.g. "
                       "'{\"method\": \"dspark\", \"model\": \"DIR\", \"num_speculative_tokens\": 4}'"
                       ) from None
    if not isinstance(value, dict):
        raise CLIError(f"--speculative-config must be a JSON object, got {type(value).__name__} "
                       f"{text!r}")
    return value


def default_tiny_model():
    from vllm.model_executor.models.tiny import write_tiny_models

    return write_tiny_models()


def default_speculative_config(paths, method: str = DEFAULT_SPECULATOR) -> dict[str, Any]:
    drafter_dir = getattr(paths, method)
    with open(os.path.join(drafter_dir, "config.json"), encoding="utf-8") as f:
        drafter = json.load(f)
    # Block drafters verify one block of Q tokens per step; AR drafters get a short chain.
    num_tokens = int(drafter.get("block_size", 3))
    return {"method": method, "model": drafter_dir, "num_speculative_tokens": num_tokens}


def resolve_model(args: argparse.Namespace, use_default_speculator: bool = True) -> str:
    """Fills args.model (and the default DSpark config for the tiny model); returns a display name."""
    model = args.model_tag or getattr(args, "model", None)
    spec = parse_speculative_config(getattr(args, "speculative_config", None))
    if model is None:
        paths = default_tiny_model()
        model = paths.target
        if spec is None and use_default_speculator:
            if getattr(args, "async_scheduling", False):
                # The default drafter is ours, not the user's: async scheduling runs plain
                # decoding, so the tiny model goes without it (said, not silent).
                print("note: --async-scheduling runs plain decoding; the tiny model's default "
                      "DSpark drafter is off", file=sys.stderr)
            else:
                spec = default_speculative_config(paths)
        display = "tiny"
    else:
        model = check_model_dir(model)
        display = os.path.basename(os.path.normpath(model))
    if spec is not None and spec.get("model") is not None:
        spec["model"] = check_model_dir(str(spec["model"]), "--speculative-config key 'model'")
    args.model = model
    if hasattr(args, "speculative_config"):
        args.speculative_config = spec
    return display


def create_vllm_config(args: argparse.Namespace, use_default_speculator: bool = True):
    """Validated VllmConfig from parsed flags (raises ValueError/CLIError on user mistakes)."""
    from vllm.engine.arg_utils import EngineArgs

    if (args.model_tag or getattr(args, "model", None)) is None:
        # Validate every flag before the built-in tiny model is written on first use: a user
        # mistake must be reported as one line, not after a progress bar and a model write.
        probe = argparse.Namespace(**vars(args))
        probe.model = None
        if hasattr(probe, "speculative_config"):
            probe.speculative_config = parse_speculative_config(probe.speculative_config)
        preflight(EngineArgs.from_cli_args(probe).create_engine_config())
    display = resolve_model(args, use_default_speculator)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    preflight(config)
    return config, display


# ---- early checks of combinations the engine would only reject after loading weights ---------
def device_capability() -> tuple[int, int] | None:
    """CUDA capability of the device we would run on (None without CUDA); tests patch this."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def preflight(config) -> None:
    parallel = config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    dcp = int(parallel.decode_context_parallel_size)
    interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1) or 1)
    device = str(getattr(config.model_config, "device", "auto"))
    _check_device(device, tp)
    _check_distributed_backend(str(getattr(parallel, "distributed_backend", "auto")), device)
    for directory in _checkpoint_dirs(config):
        check_safetensors(directory)
    if dcp < 1 or tp % dcp != 0:  # ParallelConfig already refuses this; kept for other configs
        raise CLIError(f"--tensor-parallel-size {tp} is not divisible by "
                       f"--decode-context-parallel-size {dcp}; DCP reuses TP ranks, so pick a dcp "
                       "that divides tp")
    if dcp == 1:
        return
    name = str(getattr(config.model_config, "attention_backend", "auto") or "auto").upper()
    capability = device_capability()
    backend = None
    if name == "AUTO":
        backend = _load_backend(name)
        name = backend.get_name().upper()
    if name.startswith("FLASHINFER") and interleave != 1 and capability and capability[0] == 10:
        raise CLIError(f"--cp-kv-cache-interleave-size {interleave} is not supported by "
                       f"FLASHINFER_MLA with DCP on Blackwell (sm{capability[0]}{capability[1]}): "
                       "its native DCP kernel needs interleave 1; use "
                       "--cp-kv-cache-interleave-size 1 or --attention-backend TORCH_MLA")
    spec = config.speculative_config
    if spec is None:
        return
    from vllm.v1.attention.backends.mla.common import validate_dspark_dcp_backends

    builder = (backend or _load_backend(name)).get_builder_cls()
    # Draft layers of block drafters form a non-causal group; the target group is causal.
    validate_dspark_dcp_backends(spec.method, dcp, [(True, builder), (False, builder)])


def _load_backend(name: str):
    from vllm.v1.attention.selector import get_attn_backend

    try:
        return get_attn_backend(name)
    except ImportError as error:
        raise CLIError(f"--attention-backend {name} cannot be loaded here ({error}); install its "
                       "kernels or use --attention-backend TORCH_MLA") from None


def _check_device(device: str, tp: int) -> None:
    import torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise CLIError(f"--device {device} but no CUDA device is visible here; use --device cpu "
                       "(or auto)")
    if torch.cuda.device_count() < tp:
        raise CLIError(f"--tensor-parallel-size {tp} needs {tp} GPUs but only "
                       f"{torch.cuda.device_count()} are visible; lower -tp or expose more GPUs")


def _check_distributed_backend(backend: str, device: str) -> None:
    import torch

    if backend != "nccl":
        return
    if device.startswith("cpu") or not torch.cuda.is_available():
        where = "--device cpu" if device.startswith("cpu") else "no CUDA device is visible"
        raise CLIError(f"--distributed-backend nccl needs CUDA GPUs, but {where}; use "
                       "--distributed-backend gloo (or auto) on CPU")


def _checkpoint_dirs(config) -> list[str]:
    dirs = [config.model_config.model]
    spec = config.speculative_config
    if spec is not None and getattr(spec, "model", None):
        dirs.append(spec.model)
    return [str(d) for d in dirs if d and os.path.isdir(str(d))]


def check_safetensors(directory: str) -> None:
    """Every *.safetensors file must hold its whole header and every tensor it declares: a
    truncated download is named here, in one line, instead of failing deep inside the loader
    (or inside a worker process)."""
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        problem = _safetensors_problem(path)
        if problem:
            raise CLIError(f"checkpoint file {path!r} is truncated or corrupt ({problem}); "
                           "re-download or re-write it")


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    if size < 8:
        return f"{size} bytes, shorter than the 8-byte header length"
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len > size:
            return f"header of {header_len} bytes but the file has {size} bytes"
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return f"unreadable header: {error}"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    end = max((entry.get("data_offsets", (0, 0))[1] for key, entry in header.items()
               if key != "__metadata__" and isinstance(entry, dict)), default=0)
    if 8 + header_len + end > size:
        return f"tensor data ends at byte {8 + header_len + end} but the file has {size} bytes"
    return None
