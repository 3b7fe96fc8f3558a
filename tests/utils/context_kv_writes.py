"""Shared pieces of the fused context-KV write tests (CPU interpreter driver and GPU tests):
caches bound to a block drafter's layers and the per-layer path the fused write must equal."""
from __future__ import annotations

import torch

from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.attn_utils import KVWriteOnlyMetadata


def write_only_entries(attns, slots) -> dict:
    """{layer name: KVWriteOnlyMetadata} with each layer's own slot mapping."""
    return {a.layer_name: KVWriteOnlyMetadata(slot_mapping=s) for a, s in zip(attns, slots)}


def bind_caches(attns, blocks: int, block_size: int, like: torch.Tensor,
                fill: float = 7.0) -> list[torch.Tensor]:
    """A fresh [blocks, block_size, 576] cache per layer, filled with `fill` (rows nobody
    writes keep it), bound to the layer; the device and dtype of `like`."""
    out = [torch.full((blocks, block_size, 576), fill, device=like.device, dtype=like.dtype)
           for _ in attns]
    for attn, cache in zip(attns, out):
        attn.kv_cache = cache
    return out


def per_layer_context_kv(model, attns, aux, pos, slots) -> None:
    """A drafter's context-KV write the per-layer way (write_latent_kv per layer)."""
    with set_forward_context(write_only_entries(attns, slots)):
        features = model.context_features(aux)
        for attn, slot_mapping in zip(attns, slots):
            attn.write_latent_kv(pos, features, slot_mapping)
