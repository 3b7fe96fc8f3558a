"""Create a model on its device and dtype, then stream its checkpoint into it.

Checkpoint: `model.safetensors`, or shards listed by `model.safetensors.index.json`, or else every
`*.safetensors` in the directory. Each parameter's weight_loader keeps only this TP rank's shard.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from vllm.model_executor.models.drafter_common import DEFAULT_DRAFT_PREFIX, drafter_model_dir
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.transformers_utils.config import load_hf_config


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
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
                         "or shards with model.safetensors.index.json")
    return files


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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


def get_model(vllm_config):
    """The target model of `vllm_config.model_config`, weights loaded, in eval mode."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    cls = resolve_model_cls(hf_config.architectures)
    model = _construct(cls, model_config, vllm_config=vllm_config, prefix="")
    model.load_weights(iterate_safetensors(model_config.model))
    return model.eval()


def get_draft_model(vllm_config, target_model):
    """The drafter of `vllm_config.speculative_config`, sharing the target's embedding and LM head.
    Refuses (ValueError) a target that its config does not fit."""
    spec = vllm_config.speculative_config
    model_dir = drafter_model_dir(vllm_config)
    # The method decides the drafter class: an MTP layer may live in a target checkpoint whose
    # config names the target architecture.
    cls = resolve_model_cls(load_hf_config(model_dir).architectures, method=spec.method)
    draft = _construct(cls, vllm_config.model_config, vllm_config=vllm_config, prefix=DEFAULT_DRAFT_PREFIX)
    draft.share_target(target_model)
    draft.load_weights(iterate_safetensors(model_dir))
    return draft.eval()
