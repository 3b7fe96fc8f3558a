"""Block-FP8 numerics shared by the checkpoint writer, the loader and the reference path.

DeepSeek-V3 / Kimi-K2 format: a weight W [N, K] is stored as float8_e4m3fn plus `weight_scale_inv`
[ceil(N/bn), ceil(K/bk)] float32 so that W ~= W_fp8.float() * scale of its (bn x bk) block.
Partial edge blocks (dims not multiples of the block) keep one scale each, as DeepSeek's do.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A block of zeros still needs a finite, nonzero scale (dequantises to 0 either way).
_MIN_SCALE = 1e-12


def scale_shape(weight_shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    n, k = weight_shape
    bn, bk = block
    return (-(-n // bn), -(-k // bk))


def expand_block_scale(scale: torch.Tensor, weight_shape: tuple[int, int],
                       block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] -> [N, K] (each block's scale repeated over its elements)."""
    n, k = weight_shape
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [N, K] -> (float8_e4m3fn [N, K], scale float32 [ceil(N/bn), ceil(K/bk)]) with
    scale = amax(|block|) / 448, so every block uses the full fp8 range."""
    if weight.dim() != 2:
        raise ValueError(f"block_quantize expects a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    sn, sk = scale_shape((n, k), block)
    w = weight.detach().float()
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(sn, bn, sk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).div(FP8_MAX).clamp(min=_MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(sn * bn, sk * bk)[:n, :k].contiguous(), scale.contiguous()


def block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact inverse of the storage format: W_fp8.float() * block scale, then cast to `dtype`."""
    n, k = weight.shape
    expected = scale_shape((n, k), block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale.shape)} does not fit weight {(n, k)} "
                         f"with block {list(block)}: expected {expected}")
    full = expand_block_scale(scale.float(), (n, k), block)
    return (weight.float() * full).to(dtype)


def per_token_group_quant_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantisation in torch (the Triton kernel's oracle): x [M, K] -> (fp8 [M, K],
    scale float32 [M, ceil(K/group)]), scale = amax(|group|) / 448."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    g = padded.view(m, groups, group_size)
    scale = g.abs().amax(dim=-1).div(FP8_MAX).clamp(min=_MIN_SCALE)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, -1)[:, :k]
    return q.contiguous(), scale
