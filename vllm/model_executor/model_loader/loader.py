"""Create a model on its device and dtype, then stream its checkpoint into it.

Checkpoint: `model.safetensors`, or shards listed by `model.safetensors.index.json`, or else every
`*.safetensors` in the directory. Each parameter's weight_loader keeps only this TP rank's shard.
`load_format=dummy` skips the files and fills every parameter with seeded random values instead.
Quantisation (fp8) converts the eligible linear layers after construction, before loading.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from vllm.model_executor.layers.quantization import get_quant_config, resolve_quantization
from vllm.model_executor.model_loader.dummy import fill_dummy_weights
from vllm.model_executor.models.drafter_common import DEFAULT_DRAFT_PREFIX, drafter_model_dir
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.transformers_utils.config import load_hf_config


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map' "
                             f"object): {type(e).__name__}: {e}") from None
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if absent:
            raise ValueError(f"{index} lists shard files that do not exist: {absent}")
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir!r}; the directory needs model.safetensors "
                         "or shards with model.safetensors.index.json (or pass --load-format dummy)")
    return files


def _corrupt(path: str, error: Exception) -> ValueError:
    reason = " ".join(str(error).split())
    return ValueError(f"{path} is not a readable safetensors file (truncated or corrupt: {reason}); "
                      "re-download or rewrite it")


@contextlib.contextmanager
def _open_safetensors(path: str):
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise _corrupt(path, e) from None
    with handle as f:
        yield f


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for path in safetensors_files(model_dir):
        with _open_safetensors(path) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                    raise _corrupt(path, e) from None
                yield name, tensor


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    """Tensor names from the safetensors headers only (no tensor data is read)."""
    names: set[str] = set()
    for path in safetensors_files(model_dir):
        with _open_safetensors(path) as f:
            names.update(f.keys())
    return names


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _device_and_dtype(model_config) -> tuple[torch.device, torch.dtype]:
    device = getattr(model_config, "resolved_device", None) or "cpu"
    dtype = getattr(model_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.device(device), dtype


def _construct(cls, model_config, **kwargs):
    device, dtype = _device_and_dtype(model_config)
    with _default_dtype(dtype), torch.device(device):
        model = cls(**kwargs)
    return model


def _load_format(vllm_config) -> str:
    load_config = getattr(vllm_config, "load_config", None)
    return "auto" if load_config is None else load_config.load_format


def _quantize_and_load(model, model_dir: str, hf_config, quant_flag: str | None, vllm_config) -> None:
    source = os.path.join(model_dir, "config.json")
    qc = hf_config.get("quantization_config")
    quant = get_quant_config(resolve_quantization(quant_flag, qc, source), qc, source)
    dummy = _load_format(vllm_config) == "dummy"
    if quant is not None:
        quant.apply_to(model, None if dummy else checkpoint_tensor_names(model_dir))
    if dummy:
        fill_dummy_weights(model, seed=int(getattr(vllm_config.model_config, "seed", 0) or 0))
    else:
        model.load_weights(iterate_safetensors(model_dir))


def get_model(vllm_config):
    """The target model of `vllm_config.model_config`, weights loaded, in eval mode."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    cls = resolve_model_cls(hf_config.architectures, model_type=hf_config.get("model_type"))
    model = _construct(cls, model_config, vllm_config=vllm_config, prefix="")
    _quantize_and_load(model, model_config.model, hf_config, getattr(model_config, "quantization", None),
                       vllm_config)
    return model.eval()


def get_draft_model(vllm_config, target_model):
    """The drafter of `vllm_config.speculative_config`, sharing the target's embedding and LM head.
    Refuses (ValueError) a target that its config does not fit."""
    spec = vllm_config.speculative_config
    model_dir = drafter_model_dir(vllm_config)
    # The method decides the drafter class: an MTP layer may live in a target checkpoint whose
    # config names the target architecture.
    draft_config = load_hf_config(model_dir)
    cls = resolve_model_cls(draft_config.architectures, method=spec.method)
    draft = _construct(cls, vllm_config.model_config, vllm_config=vllm_config, prefix=DEFAULT_DRAFT_PREFIX)
    draft.share_target(target_model)
    # The drafter follows its own checkpoint's quantization_config (MTP inside the target: the
    # target's); --quantization applies to the target.
    _quantize_and_load(draft, model_dir, draft_config, None, vllm_config)
    return draft.eval()
