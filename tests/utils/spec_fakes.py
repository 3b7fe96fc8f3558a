"""Small fakes for speculator unit tests: a recording metadata builder and toy drafter models.

The fakes stand in for the model (its forward contract only) and the backend builder (to see the
CommonAttentionMetadata the shared base produces); everything under test is the real code.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.worker.gpu.block_table import BlockTables

VOCAB = 64
MASK_TOKEN = 63


def brute_local_len(seq_len: int, cp_size: int, cp_rank: int, interleave: int) -> int:
    """Tokens of positions [0, seq_len) owned by cp_rank, by enumeration (DESIGN §2)."""
    return sum(1 for t in range(seq_len) if (t // interleave) % cp_size == cp_rank)


@dataclass
class Snapshot:
    """Copy of what one builder call saw (the live buffers are reused by later calls)."""
    common: object
    seq_lens: list[int]
    dcp_local_seq_lens: list[int] | None
    dcp_local_data_ptr: int | None
    upper_bound: torch.Tensor | None
    query_start_loc: list[int]
    causal: bool


class RecordingBuilder:
    def __init__(self):
        self.calls: list[Snapshot] = []

    def build(self, common_prefix_len, common_attn_metadata):
        cm = common_attn_metadata
        local = cm.dcp_local_seq_lens
        self.calls.append(Snapshot(
            common=cm,
            seq_lens=cm.seq_lens.tolist(),
            dcp_local_seq_lens=None if local is None else local.tolist(),
            dcp_local_data_ptr=None if local is None else local.data_ptr(),
            upper_bound=(None if cm.seq_lens_cpu_upper_bound is None
                         else cm.seq_lens_cpu_upper_bound.clone()),
            query_start_loc=cm.query_start_loc_cpu.tolist(),
            causal=cm.causal))
        return cm


def make_vllm_config(max_model_len: int = 1024, num_speculative_tokens: int = 3,
                     draft_dcp: int | None = None):
    # Only the fields the speculator base reads (draft DCP size None: the target's).
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens,
                                           draft_decode_context_parallel_size=draft_dcp))


def make_speculator(cls, *, cp_size=1, cp_rank=0, interleave=1, max_model_len=1024, k=3,
                    group_non_causal=(False,), draft_groups=(0,), num_reqs=4, model=None,
                    max_num_reqs=8, draft_dcp=None):
    """A speculator over real BlockTables (the ENGINE's DCP geometry cp_size/cp_rank) with
    recording builders. draft_dcp=1 under cp_size > 1: the drafter's groups are replicated."""
    block_size = 16
    replicated = draft_dcp == 1 and cp_size > 1
    sharded = [not (replicated and g in draft_groups) for g in range(len(group_non_causal))]
    block_tables = BlockTables([block_size] * len(group_non_causal), max_num_reqs, 64, 256, "cpu",
                               cp_size=cp_size, cp_rank=cp_rank, cp_interleave=interleave,
                               dcp_sharded=sharded)
    for slot in range(max_num_reqs):
        ids = list(range(slot * 8 + 1, slot * 8 + 9))
        block_tables.append_block_ids(slot, (ids,) * len(group_non_causal), overwrite=True)
    block_tables.gather_block_tables(torch.arange(num_reqs))
    kv_cache_config = KVCacheConfig(num_blocks=128, kv_cache_groups=[
        KVCacheGroupSpec([f"group{g}.attn"], MLAAttentionSpec(
            block_size=block_size, dtype=torch.float32, non_causal_multi_token_decode=flag,
            dcp_sharded=sharded[g]))
        for g, flag in enumerate(group_non_causal)], dcp_size=cp_size)
    builders = [RecordingBuilder() for _ in group_non_causal]
    speculator = cls(make_vllm_config(max_model_len, k, draft_dcp), "cpu", block_tables,
                     max_num_reqs, 256)
    speculator.bind_attention(kv_cache_config, builders, draft_groups)
    speculator.model = model
    return speculator, builders


class FakeEagleModel:
    """Predicts input_id + 1 at every row, so drafts chain anchor+1, anchor+2, ..."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, positions, hidden_states):
        assert hidden_states.shape[0] == input_ids.shape[0]
        self.calls.append((input_ids.tolist(), positions.tolist()))
        h = F.one_hot((input_ids + 1) % VOCAB, VOCAB).float()
        return h, h

    def compute_logits(self, hidden):
        return hidden


class FakeBlockModel:
    """Row logits favour (input_id + position) % V; the Markov bias favours prev + 1 strongly."""

    def __init__(self):
        self.config = SimpleNamespace(target_layer_ids=[0, 1], mask_token_id=MASK_TOKEN)
        self.calls = []
        self.context_calls = []

    def precompute_context_kv(self, aux_hidden, positions):
        self.context_calls.append((aux_hidden.shape, positions.tolist()))

    def __call__(self, input_ids, positions):
        self.calls.append((input_ids.tolist(), positions.tolist()))
        return F.one_hot((input_ids + positions) % VOCAB, VOCAB).float()

    def compute_logits(self, hidden):
        return hidden

    def markov_logits_bias(self, prev):
        return 10.0 * F.one_hot((prev + 1) % VOCAB, VOCAB).float()
