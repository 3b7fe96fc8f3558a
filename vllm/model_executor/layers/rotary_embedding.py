"""Rotary position embedding for the 64-dim rope part of MLA (interleaved or NeoX), with YaRN.

YaRN follows DeepSeek / Hugging Face: inverse frequencies blended between interpolation and
extrapolation over a linear ramp, cos/sin multiplied by the attention factor, and the softmax scale
multiplied by mscale(factor, mscale_all_dim)^2 (see `yarn_softmax_scale_factor`).
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn


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

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            half = self.head_size // 2
            x1, x2 = x[..., :half], x[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, d]; k [T, d] or [T, 1, d]. Returns rotated (q, k), same shapes."""
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is beyond max_position_embeddings="
                f"{self.cos_cache.shape[0]}; lower max_model_len"
            )
        cos = self.cos_cache[positions]
        sin = self.sin_cache[positions]
        q_rot = self._rotate(q, cos[:, None, :], sin[:, None, :])
        k_cos, k_sin = (cos, sin) if k.dim() == 2 else (cos[:, None, :], sin[:, None, :])
        return q_rot, self._rotate(k, k_cos, k_sin)


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
