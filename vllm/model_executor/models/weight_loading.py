"""Name-mapped, shape-checked loading of checkpoint tensors into a model's parameters."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm.model_executor.layers.mlp import GATE_UP_STACKED_PARAMS
from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE, block_dequantize, block_quantize
from vllm.model_executor.layers.weight_utils import WeightShapeError, default_weight_loader

_SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name: X.weight_scale_inv multiplies X.weight's fp8 blocks
_DEFAULT_BLOCK = (128, 128)

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
    block = tuple(getattr(model, "weight_block_size", None) or _DEFAULT_BLOCK)
    adapter = _Fp8Adapter(targets, params, block)
    loaded: set[str] = set()
    for name, tensor in weights:
        if _ALWAYS_IGNORED.match(name) or (ignore is not None and ignore.match(name)):
            continue
        mapped = rename(name) if rename is not None else name
        if mapped is None:
            continue
        for mapped, tensor in adapter.adapt(name, mapped, tensor):
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
    adapter.check_complete()
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing tensors for {type(model).__name__}: {shown}")
    return loaded


class _Fp8Adapter:
    """Reconciles fp8 checkpoints with the model's parameters, tensor by tensor:
    * fp8 weight into an fp8 parameter: passes through (its weight_scale_inv loads as a parameter);
    * fp8 weight into a float parameter (MoE experts, kv_b_proj, or an unquantised model): held
      until its weight_scale_inv arrives (either order), then dequantised exactly;
    * float weight into an fp8 parameter (online quantisation): block-quantised here, yielding the
      weight and its scale."""

    def __init__(self, targets: dict, params: dict, block: tuple[int, int]):
        self.targets, self.params, self.block = targets, params, block
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.source: dict[str, str] = {}

    def _param(self, mapped: str):
        entry = self.targets.get(mapped)
        return None if entry is None else self.params[entry[0]]

    def adapt(self, name: str, mapped: str, tensor: torch.Tensor):
        if mapped.endswith(_SCALE_SUFFIX) and mapped not in self.targets:
            base = mapped[:-len(_SCALE_SUFFIX)]
            yield from self._pair(base, "scale", tensor, name)
            return
        param = self._param(mapped)
        if param is None:
            yield mapped, tensor
        elif tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
            yield from self._pair(mapped, "weight", tensor, name)
        elif tensor.dtype != FP8_DTYPE and param.dtype == FP8_DTYPE:
            if tensor.dim() != 2:
                raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} cannot be "
                                 "block-quantised into an fp8 parameter (needs a 2-D weight)")
            q, scale = block_quantize(tensor, self.block)
            yield mapped, q
            yield mapped + _SCALE_SUFFIX, scale
        else:
            yield mapped, tensor

    def _pair(self, base: str, kind: str, tensor: torch.Tensor, name: str):
        slot = self.pending.setdefault(base, {})
        slot[kind] = tensor
        self.source[f"{base}:{kind}"] = name
        if "weight" in slot and "scale" in slot:
            del self.pending[base]
            param = self._param(base)
            dtype = param.dtype if param is not None else torch.float32
            try:
                weight = block_dequantize(slot["weight"], slot["scale"], self.block, dtype)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {self.source[base + ':weight']!r}: {e}") from None
            yield base, weight

    def check_complete(self) -> None:
        for base, slot in self.pending.items():
            if "weight" in slot:
                raise ValueError(f"checkpoint tensor {self.source[base + ':weight']!r} is float8_e4m3fn "
                                 f"but the checkpoint has no {base + _SCALE_SUFFIX!r} to dequantise it")
            raise ValueError(f"checkpoint tensor {self.source[base + ':scale']!r} has no fp8 weight "
                             f"{base!r} to scale (is the weight stored unquantised?)")
