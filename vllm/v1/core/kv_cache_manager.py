"""Per-request KV block bookkeeping on top of the shared BlockPool.

Blocks here are VIRTUAL blocks: under DCP every rank uses the same block id, and one id covers
`block_size * dcp_size` global tokens (each rank stores its `block_size` share). All KV cache groups
of a request share one list of block ids, so one pool serves every group.
"""
from __future__ import annotations

from vllm.v1.core.kv_cache_utils import cdiv


class KVCacheManager:

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int = 1, block_pool=None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block; "
                             "raise the KV cache memory or num_gpu_blocks_override")
        if block_size < 1 or dcp_size < 1:
            raise ValueError(f"block_size={block_size} and dcp_size={dcp_size} must be >= 1")
        if block_pool is None:
            from vllm.v1.core.kv_cache_utils import BlockPool
            block_pool = BlockPool(num_blocks)
        self.block_pool = block_pool
        self.tokens_per_block = block_size * dcp_size
        # Usable blocks (a pool may hold some back, e.g. a null block).
        self.num_total_blocks = block_pool.num_free_blocks
        self.req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0 = empty, 1 = full)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.tokens_per_block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - held)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request to cover `num_tokens` tokens; return the NEW block ids (maybe empty),
        or None, allocating nothing, when the pool lacks the blocks."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return None
        new_ids = list(self.block_pool.allocate(need)) if need else []
        self.req_to_blocks.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free(blocks)
