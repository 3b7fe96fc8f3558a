"""Name-mapped, shape-checked loading of checkpoint tensors into a model's parameters."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.mlp import GATE_UP_STACKED_PARAMS
from vllm.model_executor.layers.weight_utils import WeightShapeError, default_weight_loader

# rotary caches some exporters save; never parameters here
_ALWAYS_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def checkpoint_names_of(param_name: str, param: torch.Tensor | None = None) -> list[tuple[str, object]]:
    """Checkpoint tensor names (with shard ids) that fill parameter `param_name`.

    A parameter that stacks several checkpoint tensors (the MoE experts) lists them itself in
    `param.checkpoint_names` as (name relative to its module, shard id)."""
    listed = getattr(param, "checkpoint_names", None)
    if listed is not None:
        module = param_name.rsplit(".", 1)[0]
        return [(f"{module}.{suffix}", shard_id) for suffix, shard_id in listed]
    fused_hits = [(p, s) for f, p, s in GATE_UP_STACKED_PARAMS if f".{f}." in param_name]
    if fused_hits:
        return [(param_name.replace(".gate_up_proj.", f".{p}."), s) for p, s in fused_hits]
    return [(param_name, None)]


def checkpoint_tensors_of(param_name: str, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The inverse of loading, for an unsharded (TP=1) model: (checkpoint name, tensor) pieces of
    one parameter (fused gate_up split in two, stacked experts split per expert)."""
    names = checkpoint_names_of(param_name, param)
    data = param.detach()
    if hasattr(param, "export_shard"):
        return [(name, param.export_shard(shard_id).detach()) for name, shard_id in names]
    if len(names) == 1:
        return [(names[0][0], data)]
    return [(name, piece) for (name, _), piece in zip(names, data.chunk(len(names), dim=0))]


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                       ignore: re.Pattern | None = None, rename=None) -> set[str]:
    """Copy every checkpoint tensor into its parameter (sharding through the parameter's
    weight_loader) and insist that every parameter was filled.

    `rename(name) -> name | None` maps a checkpoint name to this model's name (None = skip).
    Errors name the tensor and both shapes (mis-shaped) or list the missing tensors.
    """
    params = dict(model.named_parameters())
    targets: dict[str, tuple[str, int | None]] = {}
    for param_name, param in params.items():
        for ckpt_name, shard_id in checkpoint_names_of(param_name, param):
            targets[ckpt_name] = (param_name, shard_id)
    loaded: set[str] = set()
    for name, tensor in weights:
        if _ALWAYS_IGNORED.match(name) or (ignore is not None and ignore.match(name)):
            continue
        mapped = rename(name) if rename is not None else name
        if mapped is None:
            continue
        if mapped not in targets:
            raise ValueError(
                f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}; "
                "is the checkpoint for a different architecture or config?"
            )
        param_name, shard_id = targets[mapped]
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except WeightShapeError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.add(mapped)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing tensors for {type(model).__name__}: {shown}")
    return loaded
