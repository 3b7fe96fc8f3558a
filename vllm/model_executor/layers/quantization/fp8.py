"""FP8 block quantisation (`quant_method: fp8` with `weight_block_size`), as DeepSeek-V3/R1 and
Kimi-K2 ship: float8_e4m3fn weights + float32 `weight_scale_inv` per 128 x 128 block, dynamic
activation scales per (token, 128 columns).

`Fp8Config.apply_to(model, checkpoint_names)` turns eligible linear layers into fp8 layers after the
model is built and before weights stream in:
* linear layers of attention, dense MLPs and shared experts become fp8;
* MoE routed experts (`.experts.`) and `kv_b_proj` stay in the model dtype and their fp8 checkpoint
  tensors are dequantised at load time (weight_loading.py): the MoE layer runs plain torch GEMMs
  and MLA's absorbed decode reads kv_b_proj's raw weight (W_UK / W_UV), as upstream also
  dequantises it;
* the LM head, embeddings, router and norms are not linear layers here and stay unquantised.
With an fp8 checkpoint, a layer is fp8 exactly when the checkpoint holds its `weight_scale_inv`;
with a bf16/fp32 checkpoint (or dummy weights) every eligible layer is quantised online at load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE, block_dequantize, scale_shape

DEFAULT_BLOCK = (128, 128)
# Linear layers never converted (see the module docstring for why).
_KEEP_UNQUANTIZED = (".experts.", "kv_b_proj")


@dataclass
class Fp8Config:
    weight_block_size: tuple[int, int] = DEFAULT_BLOCK
    activation_scheme: str = "dynamic"
    ignored_layers: list[str] = field(default_factory=list)

    @classmethod
    def from_hf(cls, qc: dict | None, source: str = "config.json") -> "Fp8Config":
        if not qc:
            return cls()
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError(f"{source}: quantization_config has quant_method 'fp8' without "
                             "weight_block_size; only block-quantised fp8 (e.g. [128, 128]) is supported")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{source}: quantization_config.weight_block_size={block!r} is invalid; "
                             "expected two positive ints such as [128, 128]")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"{source}: quantization_config.activation_scheme={scheme!r} is not "
                             "supported; only 'dynamic' (per-token-group scales) is")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{source}: quantization_config.fmt={fmt!r} is not supported; use 'e4m3'")
        ignored = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        return cls(weight_block_size=(int(block[0]), int(block[1])), activation_scheme=scheme,
                   ignored_layers=ignored)

    def is_eligible(self, module_name: str) -> bool:
        if any(k in module_name for k in _KEEP_UNQUANTIZED):
            return False
        return not any(module_name == n or module_name.startswith(n + ".") or module_name.endswith("." + n)
                       for n in self.ignored_layers)

    def apply_to(self, model: nn.Module, checkpoint_names: set[str] | None = None) -> list[str]:
        """Convert eligible linear layers to fp8; returns their module names."""
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.models.weight_loading import checkpoint_names_of

        model.weight_block_size = self.weight_block_size
        serialized = checkpoint_names is not None and any(n.endswith(".weight_scale_inv")
                                                          for n in checkpoint_names)
        converted = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase) or not self.is_eligible(name):
                continue
            if serialized:
                scale_names = [c for c, _ in checkpoint_names_of(f"{name}.weight_scale_inv")]
                if not all(c in checkpoint_names for c in scale_names):
                    continue  # shipped unquantised (e.g. a bf16 eh_proj): keep it so
            Fp8LinearMethod(self.weight_block_size).create_weights(module, name)
            converted.append(name)
        return converted


_FP8_MMA: dict[int, bool] = {}


def _has_fp8_mma(device: torch.device) -> bool:
    """fp8 tensor-core MMA (tl.dot on float8) needs compute capability 8.9+ (Ada, Hopper, Blackwell);
    older GPUs take the dequantised path. Queried once per device (host-side, no sync)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FP8_MMA:
        _FP8_MMA[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _FP8_MMA[index]


class Fp8LinearMethod:
    """Holds `weight` (float8_e4m3fn, this rank's shard) and `weight_scale_inv` (float32 block
    scales of that shard). CUDA + triton (compute capability 8.9+): the Triton block-FP8 GEMMs of
    fp8_kernels.py (W8A16 weight streaming for decode-sized batches, W8A8 above); otherwise exact
    dequantisation."""

    def __init__(self, block: tuple[int, int]):
        self.block = tuple(block)

    def create_weights(self, layer: nn.Module, name: str) -> None:
        bn, bk = self.block
        n, k = layer.weight.shape
        kind = type(layer).__name__
        # A TP shard (or one projection of a merged layer) must start on a block boundary, else
        # its scales would mix with the neighbouring shard's.
        if getattr(layer, "tp_size", 1) > 1 or getattr(layer, "local_sizes", None):
            if getattr(layer, "shards_output", False):
                sizes = getattr(layer, "local_sizes", None) or [n]
                bad = [s for s in sizes if s % bn]
                if bad:
                    raise ValueError(f"fp8 layer {name} ({kind}): per-rank output size(s) {bad} are not "
                                     f"multiples of weight_block_size[0]={bn}; use a tensor_parallel_size "
                                     "that keeps shards block-aligned")
            if getattr(layer, "shards_input", False) and k % bk:
                raise ValueError(f"fp8 layer {name} ({kind}): per-rank input size {k} is not a multiple "
                                 f"of weight_block_size[1]={bk}; use a tensor_parallel_size that keeps "
                                 "shards block-aligned")
        device = layer.weight.device
        weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
        weight.weight_loader = layer.weight.weight_loader
        scale = nn.Parameter(torch.empty(scale_shape((n, k), self.block), dtype=torch.float32, device=device),
                             requires_grad=False)
        scale.weight_loader = layer.scale_loader(self.block)
        del layer.weight
        layer.weight = weight
        layer.weight_scale_inv = scale
        layer.quant_method = self

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return block_dequantize(layer.weight, layer.weight_scale_inv, self.block, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and _has_fp8_mma(x.device):
            from vllm.model_executor.layers.quantization.fp8_kernels import apply_w8a8_block_fp8_linear
            return apply_w8a8_block_fp8_linear(x, layer.weight, layer.weight_scale_inv, self.block, bias)
        return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)
