"""`--load-format dummy`: seeded random weights of the right shapes, generated on the parameters'
device (no checkpoint files, no host round trip), for benchmarks at real dimensions.

Scaled so activations stay finite through many layers: norm weights 1, biases and the router's
correction bias 0, embeddings N(0, 1), every matrix N(0, 1/fan_in) (fan_in = its last dim), which
keeps each projection's output at unit scale; the residual stream then grows only like
sqrt(layers) and RMSNorm re-normalises every sublayer input. fp8 layers get the same values
block-quantised with their real scales.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE, block_quantize

_CHUNK_ROWS = 8192  # bounds the float32 temporary of one large fp8 matrix


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    # Per-parameter seeds: values do not depend on parameter order or on which params exist.
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    return gen


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        gen = _generator(param.device, seed, name)
        owner = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        if name.endswith("weight_scale_inv"):
            continue  # written together with its fp8 weight below
        if param.dim() == 1:
            if isinstance(owner, RMSNorm):
                param.fill_(1.0)
            else:
                param.zero_()
            continue
        fan_in = param.shape[-1]
        std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(fan_in)
        # Same float32 draws (row chunks of one generator) for every dtype: an fp8 model gets
        # exactly the block-quantised values of the bf16 model with the same seed.
        fp8 = param.dtype == FP8_DTYPE
        bn = owner.quant_method.block[0] if fp8 else 1
        step = max(bn, (_CHUNK_ROWS // bn) * bn)
        for start in range(0, param.shape[0], step):
            rows = param[start:start + step]
            w = torch.randn(rows.shape, generator=gen, device=param.device, dtype=torch.float32) * std
            if fp8:
                q, s = block_quantize(w, owner.quant_method.block)
                rows.copy_(q)
                owner.weight_scale_inv[start // bn:start // bn + s.shape[0]].copy_(s)
            else:
                rows.copy_(w)
