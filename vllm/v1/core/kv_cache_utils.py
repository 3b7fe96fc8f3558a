"""KV cache sizing and bookkeeping: layer grouping, the block pool, blocks from a memory budget.

All groups share one BlockPool: a request gets one list of block ids, copied into every group's
block table, and every layer owns its own tensor [pages, block_size, 576]. Under DCP one block
id stands for a virtual block of block_size * dcp_size global tokens (DESIGN §2); a DCP-sharded
layer keeps one page per id, a replicated (non-DCP drafter) layer dcp_size pages per id, so the
memory budget prices each layer by `spec.pages_per_block_id(dcp_size)`.
"""
from __future__ import annotations

from collections import Counter, deque
from numbers import Integral
from typing import Iterable, Mapping

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; nothing was allocated."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_virtual_blocks(num_tokens: int, block_size: int, dcp_size: int = 1) -> int:
    """Block ids needed to hold `num_tokens` global tokens when each id covers block_size*dcp_size."""
    return cdiv(num_tokens, block_size * dcp_size)


def group_layers_into_kv_cache_groups(
        specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """One group if all specs merge; otherwise one group per distinct spec, in layer order.

    Merging refuses specs that disagree on causality (MLAAttentionSpec.merge), so causal target
    layers and non-causal draft layers of identical geometry always end up in separate groups.
    """
    if len(specs) == 0:
        raise ValueError("specs is empty: there are no attention layers to group.")
    layer_specs = list(specs.values())
    spec_type = type(layer_specs[0])
    if all(type(s) is spec_type for s in layer_specs):
        try:
            merged = spec_type.merge(layer_specs)
        except AssertionError:
            pass
        else:
            return [KVCacheGroupSpec(layer_names=list(specs), kv_cache_spec=merged)]
    groups: dict[KVCacheSpec, list[str]] = {}  # dicts keep first-appearance order
    for name, spec in specs.items():
        groups.setdefault(spec, []).append(name)
    return [KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)
            for spec, names in groups.items()]


def _page_sizes(specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
                dcp_size: int = 1) -> list[int]:
    """Bytes every layer spends per block id (replicated layers: dcp_size pages)."""
    values = specs.values() if isinstance(specs, Mapping) else specs
    return [spec.page_size_bytes * spec.pages_per_block_id(dcp_size) for spec in values]


def _check_dcp_size(dcp_size) -> None:
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1:
        raise ValueError(f"dcp_size={dcp_size!r} is invalid: pass the DCP world size (an int >= 1).")


def get_num_blocks(memory_bytes: int, specs: Mapping[str, KVCacheSpec] | Iterable[KVCacheSpec],
                   dcp_size: int = 1) -> int:
    """How many block ids fit in `memory_bytes`: a sharded layer holds one page per block id,
    a replicated layer `dcp_size` pages (it keeps the whole virtual block)."""
    if not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise ValueError(f"memory_bytes={memory_bytes!r} is invalid: it must be an int >= 0.")
    _check_dcp_size(dcp_size)
    page_sizes = _page_sizes(specs, dcp_size)
    if not page_sizes:
        raise ValueError("specs is empty: there are no attention layers to size the cache for.")
    bytes_per_block = sum(page_sizes)
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"memory_bytes={memory_bytes} cannot hold a single block: one block id costs "
            f"{bytes_per_block} bytes over {len(page_sizes)} layers; raise kv_cache_memory_bytes "
            "or shrink block_size.")
    return num_blocks


def get_kv_cache_config(specs: Mapping[str, KVCacheSpec], memory_bytes: int | None = None,
                        num_blocks: int | None = None, dcp_size: int = 1) -> KVCacheConfig:
    """Group the layers and size the pool from exactly one of `memory_bytes` or `num_blocks`.
    `dcp_size` prices replicated (dcp_sharded=False) groups at dcp_size pages per block id."""
    if (memory_bytes is None) == (num_blocks is None):
        raise ValueError(
            f"pass exactly one of memory_bytes={memory_bytes!r} or num_blocks={num_blocks!r}.")
    _check_dcp_size(dcp_size)
    if num_blocks is None:
        num_blocks = get_num_blocks(memory_bytes, specs, dcp_size)
    elif not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks!r} is invalid: it must be an int >= 1.")
    return KVCacheConfig(num_blocks=num_blocks,
                         kv_cache_groups=group_layers_into_kv_cache_groups(specs),
                         dcp_size=dcp_size)


class BlockPool:
    """Hands out block ids with reference counts; a block returns to the pool at count zero.

    Freed blocks go to the back of the free queue, so recently freed ids are reused last.
    Every method validates its whole input before changing anything.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is invalid: it must be an int >= 1.")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (the kv_cache_usage metric)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_ids([block_id])
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} is invalid: the number of blocks must be an int >= 0.")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"requested {n} KV cache blocks but only {len(self._free)} of {self.num_blocks} "
                "are free; free finished requests first, preempt one, or raise the KV cache size.")
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; only allocated blocks can be shared.")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        self._check_ids(block_ids)
        for block_id, times in Counter(block_ids).items():
            if self._ref_counts[block_id] < times:
                raise ValueError(
                    f"block {block_id} is freed {times} time(s) but holds only "
                    f"{self._ref_counts[block_id]} reference(s): it is free or not owned.")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def _check_ids(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not isinstance(block_id, Integral) or not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"block id {block_id!r} is invalid: ids are ints in [0, {self.num_blocks}).")
