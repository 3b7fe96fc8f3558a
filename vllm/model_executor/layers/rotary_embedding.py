"""Rotary position embedding for the 64-dim rope part of MLA (interleaved or NeoX), with YaRN.

YaRN follows DeepSeek / Hugging Face: inverse frequencies blended between interpolation and
extrapolation over a linear ramp, cos/sin multiplied by the attention factor, and the softmax scale
multiplied by mscale(factor, mscale_all_dim)^2 (see `yarn_softmax_scale_factor`).

On CUDA the rotation is a Triton kernel (`rope_triton`): it reads the float32 cos/sin rows of each
token's position and rotates q and k in registers, so q/k are never copied to float32 in memory.
`rope_pairs` is the one rotation formula, shared with the fused rope + KV-cache write of MLA.
Elsewhere (and for float64) it is torch (`rope_torch`), matching Hugging Face exactly.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from vllm.triton_utils import HAS_TRITON, tl, triton  # noqa: F401


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_settings(config) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either `rope_scaling` (DeepSeek checkpoints) or the
    Hugging Face 5 `rope_parameters` field. The scaling dict always carries `rope_type`."""
    params, scaling, theta = config.get("rope_parameters"), config.get("rope_scaling"), config.get("rope_theta")
    if params:
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if theta is None:
        theta = 10000.0
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return float(theta), None
        if rope_type not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; use 'yarn' or none")
        scaling["rope_type"] = "yarn"
        return float(theta), scaling
    return float(theta), None


def yarn_softmax_scale_factor(config) -> float:
    """Multiplier DeepSeek applies to the softmax scale under YaRN (1.0 without scaling)."""
    _, scaling = rope_settings(config)
    if not scaling:
        return 1.0
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(_yarn_factor(scaling, config), mscale_all_dim)
    return m * m


def _yarn_factor(scaling: dict[str, Any], config) -> float:
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq_and_attention_factor(dim: int, base: float, scaling: dict[str, Any], config):
    factor = _yarn_factor(scaling, config)
    original_max = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep_extrapolated = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolated) + extrapolation * keep_extrapolated

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    return inv_freq, float(attention_factor)


# (max_position, inv_freq, attention_factor, device) -> cos / sin table. Every MLA layer of a model
# builds the same rope, so the [max_position, d/2] tables are built once and shared (each layer its own
# copy would be ~40 MB per layer at DeepSeek-V3's 163840 positions). Weak values: a table lives as long
# as some module holds it; `.to()` / `.half()` give a module new tensors and leave these untouched.
_COS_SIN_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _cos_sin_tables(max_position: int, inv_freq: torch.Tensor,
                    attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    device = torch.empty(0).device  # the device this module is being built on
    key = (max_position, tuple(inv_freq.tolist()), attention_factor, str(device))
    cos, sin = _COS_SIN_TABLES.get(key + ("cos",)), _COS_SIN_TABLES.get(key + ("sin",))
    if cos is None or sin is None:
        # float32 angles, as Hugging Face computes them, so logits agree at 1e-4 even at long positions
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        _COS_SIN_TABLES[key + ("cos",)], _COS_SIN_TABLES[key + ("sin",)] = cos, sin
    return cos, sin


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., d] by cos/sin [..., d/2] (broadcast) in float32; result in x's dtype."""
    dtype = x.dtype
    x = x.float()
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)


def check_positions(positions: torch.Tensor, max_position: int) -> None:
    """Host-side range check, CPU tensors only: on CUDA it would cost a device->host sync per layer
    (and cannot run inside CUDA-graph capture), so there the engine's max_model_len check stands."""
    if positions.is_cuda or not positions.numel():
        return
    hi, lo = int(positions.max()), int(positions.min())
    if hi >= max_position or lo < 0:
        bad = hi if hi >= max_position else lo
        raise ValueError(f"position {bad} is outside [0, max_position_embeddings={max_position}); "
                         "lower max_model_len")


def use_triton_rope(x: torch.Tensor, cos_cache: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda and x.dtype != torch.float64 and cos_cache.dtype == torch.float32


if HAS_TRITON:

    @triton.jit
    def rope_pairs(x_base, d1, d2, cos, sin, mask):
        """Load the rotated pairs (x[d1], x[d2]) and return their rotation in float32."""
        x1 = tl.load(x_base + d1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + d2, mask=mask, other=0.0).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @triton.jit
    def rope_offsets(HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
        """(pair index i, offset of its first and second element, mask) for one head."""
        i = tl.arange(0, BLOCK_HALF)
        if INTERLEAVED:
            d1 = 2 * i
            d2 = 2 * i + 1
        else:
            d1 = i
            d2 = i + HALF
        return i, d1, d2, i < HALF

    @triton.jit
    def _rope_kernel(pos_ptr, cos_ptr, sin_ptr, table_stride, q_ptr, q_st, q_sh, qo_ptr, qo_st, qo_sh,
                     num_heads, k_ptr, k_st, ko_ptr, ko_st, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_Q: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        i, d1, d2, dmask = rope_offsets(HALF, BLOCK_HALF, INTERLEAVED)
        cos = tl.load(cos_ptr + pos * table_stride + i, mask=dmask, other=0.0)
        sin = tl.load(sin_ptr + pos * table_stride + i, mask=dmask, other=0.0)
        if HAS_Q:
            h = tl.arange(0, BLOCK_H)
            qmask = (h < num_heads)[:, None] & dmask[None, :]
            o1, o2 = rope_pairs(q_ptr + t * q_st + h[:, None] * q_sh, d1[None, :], d2[None, :],
                                cos[None, :], sin[None, :], qmask)
            q_out = qo_ptr + t * qo_st + h[:, None] * qo_sh
            tl.store(q_out + d1[None, :], o1.to(qo_ptr.dtype.element_ty), mask=qmask)
            tl.store(q_out + d2[None, :], o2.to(qo_ptr.dtype.element_ty), mask=qmask)
        o1, o2 = rope_pairs(k_ptr + t * k_st, d1, d2, cos, sin, dmask)
        tl.store(ko_ptr + t * ko_st + d1, o1.to(ko_ptr.dtype.element_ty), mask=dmask)
        tl.store(ko_ptr + t * ko_st + d2, o2.to(ko_ptr.dtype.element_ty), mask=dmask)


def rope_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                sin_cache: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, H, d] and k [T, d] / [T, 1, d] in one launch (no float32 copies)."""
    num_tokens, d = k.shape[0], k.shape[-1]
    k2 = k.reshape(num_tokens, d)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty_like(k2)
    num_heads = q.shape[1]
    half = d // 2
    positions = positions.contiguous()  # the kernel reads positions[t] at offset t
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            positions, cos_cache, sin_cache, cos_cache.stride(0), q, q.stride(0), q.stride(1),
            q_out, q_out.stride(0), q_out.stride(1), num_heads, k2, k2.stride(0), k_out, k_out.stride(0),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(max(num_heads, 1)),
            INTERLEAVED=interleaved, HAS_Q=num_heads > 0, num_warps=4 if num_heads <= 32 else 8)
    return q_out, k_out.view(k.shape)


class RotaryEmbedding(nn.Module):
    """Rotates q_pe / k_pe in place of their layout.

    interleaved=True rotates pairs (x0, x1), (x2, x3), ... (DeepSeek's `rope_interleave`);
    interleaved=False rotates (x_i, x_{i+d/2}) (NeoX). Hugging Face's interleaved path writes its
    output de-interleaved, but it does so for q and k alike, so q.k (and the logits) are the same.
    """

    def __init__(self, head_size: int, max_position: int, base: float, interleaved: bool,
                 scaling: dict[str, Any] | None = None, config=None):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.interleaved = interleaved
        if scaling:
            inv_freq, attention_factor = _yarn_inv_freq_and_attention_factor(head_size, base, scaling, config)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
            attention_factor = 1.0
        self.attention_factor = attention_factor
        cos, sin = _cos_sin_tables(max_position, inv_freq, attention_factor)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, d]; k [T, d] or [T, 1, d]. Returns rotated (q, k), same shapes."""
        if q.shape[-1] != self.head_size or k.shape[-1] != self.head_size:
            raise ValueError(f"rope of head_size {self.head_size} got q {tuple(q.shape)} / k {tuple(k.shape)}")
        if use_triton_rope(q, self.cos_cache):
            return rope_triton(positions, q, k, self.cos_cache, self.sin_cache, self.interleaved)
        check_positions(positions, self.cos_cache.shape[0])
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        q_rot = rope_torch(q, cos[:, None, :], sin[:, None, :], self.interleaved)
        k_cos, k_sin = (cos, sin) if k.dim() == 2 else (cos[:, None, :], sin[:, None, :])
        return q_rot, rope_torch(k, k_cos, k_sin, self.interleaved)


def get_rope(config) -> RotaryEmbedding:
    base, scaling = rope_settings(config)
    return RotaryEmbedding(
        head_size=config.qk_rope_head_dim,
        max_position=config.max_position_embeddings,
        base=base,
        interleaved=bool(config.rope_interleave),
        scaling=scaling,
        config=config,
    )
