"""Worker KV sizing with a replicated draft group: the budget prices it at dcp_size pages per
block id, and the KV cache config handed to the runner carries the DCP size."""
import torch

from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.worker.gpu.worker import Worker


class _SpecOnlyRunner:
    """Stands in for the model runner: the worker only needs its specs and the config it gets."""

    def __init__(self, specs):
        self.specs = specs
        self.kv_cache_config = None

    def get_kv_cache_spec(self):
        return self.specs

    def initialize_kv_cache(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config


def test_worker_prices_replicated_draft_pages_and_passes_the_dcp_size():
    target = MLAAttentionSpec(16, dtype=torch.float32)
    draft = MLAAttentionSpec(16, dtype=torch.float32, non_causal_multi_token_decode=True,
                             dcp_sharded=False)
    page = target.page_size_bytes
    # 2 target layers (1 page per id) + 1 replicated draft layer (2 pages per id at DCP 2).
    budget = 10 * (2 * page + 2 * page) + page
    cfg = VllmConfig(cache_config=CacheConfig(block_size=16, kv_cache_memory_bytes=budget),
                     parallel_config=ParallelConfig(tensor_parallel_size=2,
                                                    decode_context_parallel_size=2))
    worker = Worker(cfg, rank=0)
    worker.model_runner = _SpecOnlyRunner({"t0": target, "t1": target, "d0": draft})
    num_blocks = worker.determine_num_available_blocks()
    assert num_blocks == 10
    worker.initialize_kv_cache(num_blocks)
    kv = worker.model_runner.kv_cache_config
    assert kv.dcp_size == 2 and kv.num_blocks == 10
    pages = {tuple(g.layer_names): kv.group_num_blocks(i)
             for i, g in enumerate(kv.kv_cache_groups)}
    assert pages == {("t0", "t1"): 10, ("d0",): 20}
