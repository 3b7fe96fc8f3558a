"""What one attention layer needs from the paged KV cache, and how layers form KV cache groups.

A KV cache group is a set of layers that share one attention-metadata builder, hence one causal
mode per step. Causal target MLA layers and a DSpark/DFlash draft's non-causal MLA layers may have
identical geometry, so `MLAAttentionSpec.merge` refuses specs that disagree on
`non_causal_multi_token_decode`: mixing them silently gives NaNs and repeated tokens (DESIGN §1.3).

`dcp_sharded` is a group property too: a sharded group stores only this rank's DCP share of every
virtual block; a replicated group (a non-DCP drafter under a DCP target, upstream RFC #53673)
stores the whole context on every rank, so one block id costs it `dcp_size` pages. Groups that
differ in sharding never merge (different block tables, slot mappings and builders).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

NON_CAUSAL_AGREEMENT_MESSAGE = (
    "All attention layers in the same KV cache group must agree on non_causal_multi_token_decode")


DCP_SHARDING_AGREEMENT_MESSAGE = (
    "All attention layers in the same KV cache group must agree on dcp_sharded (a DCP-sharded "
    "target and a replicated drafter need separate groups)")


def _require(condition: bool, message: str) -> None:
    # Explicit raise instead of `assert`: the invariant must hold under `python -O` too.
    if not condition:
        raise AssertionError(message)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec: one block holds `block_size` tokens of one layer."""

    block_size: int
    # False: the layer keeps the FULL context on every DCP rank (replicated draft KV). Keyword
    # only, so subclasses keep their positional fields.
    dcp_sharded: bool = field(default=True, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} is invalid: it must be an int >= 1.")
        if not isinstance(self.dcp_sharded, bool):
            raise ValueError(f"dcp_sharded={self.dcp_sharded!r} is invalid: pass True (KV split "
                             "over the DCP ranks) or False (full KV on every rank).")

    def pages_per_block_id(self, dcp_size: int) -> int:
        """Physical pages of this layer's cache per (virtual) block id: a block id covers
        block_size * dcp_size global tokens, of which a sharded rank stores block_size and a
        replicated rank all of them."""
        return 1 if self.dcp_sharded else int(dcp_size)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not define page_size_bytes")

    @classmethod
    def merge(cls, specs: list["KVCacheSpec"]) -> "KVCacheSpec":
        """Combine the specs of layers sharing one group; raises AssertionError if they can't."""
        _require(len(specs) > 0, "merge needs at least one spec")
        _require(all(isinstance(s, cls) for s in specs),
                 f"All specs must be {cls.__name__}, got {sorted({type(s).__name__ for s in specs})}")
        first = specs[0]
        for spec in specs[1:]:
            _require(spec == first, f"KV cache specs differ and cannot merge: {first} vs {spec}")
        return first


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be an int >= 1.")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype={self.dtype!r} is invalid: pass a torch.dtype.")

    @property
    def page_size_bytes(self) -> int:
        # Separate K and V tensors.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Plain causal attention over all previous tokens."""


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one 576-wide latent per token ([c_kv 512 | k_pe 64]), no V.

    `non_causal_multi_token_decode` marks layers (DSpark/DFlash drafts) that decode a block of
    query tokens which all see each other.
    """

    num_kv_heads: int = 1
    head_size: int = 576
    dtype: torch.dtype = torch.bfloat16
    non_causal_multi_token_decode: bool = False

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @classmethod
    def merge(cls, specs: list["KVCacheSpec"]) -> "MLAAttentionSpec":
        _require(len(specs) > 0, "merge needs at least one spec")
        _require(all(isinstance(s, MLAAttentionSpec) for s in specs),
                 f"All specs must be MLAAttentionSpec, got {sorted({type(s).__name__ for s in specs})}")
        flags = {s.non_causal_multi_token_decode for s in specs}
        _require(len(flags) == 1, NON_CAUSAL_AGREEMENT_MESSAGE)
        _require(len({s.dcp_sharded for s in specs}) == 1, DCP_SHARDING_AGREEMENT_MESSAGE)
        first = specs[0]
        for spec in specs[1:]:
            for f in fields(MLAAttentionSpec):
                _require(getattr(spec, f.name) == getattr(first, f.name),
                         f"MLA specs disagree on {f.name}: {getattr(first, f.name)} vs "
                         f"{getattr(spec, f.name)}; such layers cannot share a KV cache group")
        return first


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, one slot mapping and one metadata builder."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """How many block ids the pool has, and how layers are grouped.

    All groups share the same block ids (one BlockPool). Every layer owns its own tensor of
    `group_num_blocks(g)` pages: `num_blocks` for DCP-sharded groups, `num_blocks * dcp_size` for
    replicated ones (block id b owns pages b*dcp_size .. b*dcp_size + dcp_size - 1 there).
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
    dcp_size: int = 1  # the DCP size the pool was sized for

    def group_num_blocks(self, group_id: int) -> int:
        """Pages of every layer tensor of group `group_id` (its own block count)."""
        spec = self.kv_cache_groups[group_id].kv_cache_spec
        return self.num_blocks * spec.pages_per_block_id(self.dcp_size)

    @property
    def layer_names(self) -> list[str]:
        return [name for group in self.kv_cache_groups for name in group.layer_names]
