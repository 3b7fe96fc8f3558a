"""Write the MLA latent ([c_kv | k_pe]) of new tokens into the paged cache."""
from __future__ import annotations

import torch


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """kv_c [T, 512], k_pe [T, 64] -> kv_cache [blocks, block_size, 576] at `slot_mapping` [T].

    Slots equal to -1 are skipped: under DCP another rank stores that token (PAD),
    and CUDA-graph padding tokens carry -1 too.
    """
    width = kv_c.shape[-1] + k_pe.shape[-1]
    if kv_cache.shape[-1] != width:
        raise ValueError(f"concat_and_cache_mla: cache last dim {kv_cache.shape[-1]} != "
                         f"kv_c {kv_c.shape[-1]} + k_pe {k_pe.shape[-1]}.")
    num_tokens = slot_mapping.shape[0]
    if kv_c.shape[0] < num_tokens or k_pe.shape[0] < num_tokens:
        raise ValueError(f"concat_and_cache_mla: {num_tokens} slots but kv_c has "
                         f"{kv_c.shape[0]} and k_pe {k_pe.shape[0]} tokens.")
    flat = kv_cache.view(-1, width)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    latent = torch.cat([kv_c[:num_tokens], k_pe[:num_tokens]], dim=-1).to(kv_cache.dtype)
    # Boolean selection keeps PAD tokens out entirely (no scratch row is written).
    flat.index_copy_(0, slots[keep], latent[keep])
