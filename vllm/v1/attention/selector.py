"""Backend registry: pick an attention backend by name (or automatically)."""
from __future__ import annotations

import importlib

import torch

from vllm.v1.attention.backend import AttentionBackend

# name -> "module:Class"; imported lazily so FlashInfer is only touched when chosen.
_REGISTRY = {
    "TORCH_MLA": "vllm.v1.attention.backends.mla.torch_mla:TorchMLABackend",
    "FLASHINFER_MLA": "vllm.v1.attention.backends.mla.flashinfer_mla:FlashInferMLABackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def _load(name: str) -> type[AttentionBackend]:
    module_name, cls_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def _flashinfer_usable(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return False
    try:
        importlib.import_module("flashinfer")
    except Exception:  # missing or broken install: fall back to the exact backend
        return False
    return True


def get_attn_backend(name: str | None = "auto", device=None) -> type[AttentionBackend]:
    """TORCH_MLA / FLASHINFER_MLA by name; "auto" (or None) = FlashInfer on CUDA sm90/sm100
    when importable, else TORCH_MLA."""
    if name is None or name.lower() == "auto":
        if device is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return _load("FLASHINFER_MLA" if _flashinfer_usable(torch.device(device)) else "TORCH_MLA")
    key = name.upper()
    if key not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{available_backends() + ['auto']}.")
    return _load(key)
