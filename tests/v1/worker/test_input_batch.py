"""InputBatch preparation (device side, from the slot-indexed request state) against a brute-force
host computation, on random batches: DCP 1/2/4, interleave 1/4, speculative k 0..7, decode and
prefill rows, CUDA-graph padding. And: padding rows never change the real rows' results."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.utils.dcp_oracle import brute_local_len
from tests.utils.input_batch_cases import (BLOCK, MAX_REQS, MAX_TOKENS, brute_step_inputs,
                                          random_batch)
from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.v1.worker.gpu.input_batch import InputBatchBuilder

@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 1), (2, 4), (4, 1), (4, 4)])
@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_input_batch_equals_brute_force(seed, dcp, interleave, k):
    rank = seed % dcp
    states, tables, rows, counts, drafts, samples, host_ids, expect = random_batch(
        seed * 31 + k, k, dcp, rank, interleave)
    builder = InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k, dcp, rank,
                                interleave)
    pad_rows = len(rows) + (seed % 3)
    pad_tokens = sum(counts) + (seed % 4) * 3
    batch = builder.build(rows, counts, drafts, samples, host_ids, states, tables,
                          num_reqs_padded=pad_rows, num_tokens_padded=pad_tokens)
    ids, pos, seq, logits_idx, slots = brute_step_inputs(
        [(slot, computed, row_ids, count, n_drafts, sample) for (slot, computed, row_ids), count,
         n_drafts, sample in zip(expect, counts, drafts, samples)],
        tables.host_block_tables, 1, BLOCK, dcp, rank, interleave)
    slots0 = slots[0]
    T = len(ids)
    assert batch.num_tokens == T and batch.num_tokens_padded == pad_tokens
    assert batch.input_ids[:T].tolist() == ids
    assert batch.positions[:T].tolist() == pos
    assert batch.input_ids[T:].tolist() == [0] * (pad_tokens - T)  # padding tokens
    assert batch.seq_lens[: len(seq)].tolist() == seq
    assert batch.seq_lens[len(seq):].tolist() == [0] * (pad_rows - len(seq))
    assert batch.seq_lens_np[: len(seq)].tolist() == seq
    assert batch.logits_indices.tolist() == logits_idx
    qsl = [0] + np.cumsum(counts).tolist() + [T] * (pad_rows - len(rows))
    assert batch.query_start_loc.tolist() == qsl
    assert batch.query_start_loc_np.tolist() == qsl
    assert batch.slot_mappings[0, :T].tolist() == slots0
    assert batch.slot_mappings[:, T:].eq(-1).all()
    if dcp > 1:
        local = [brute_local_len(s, dcp, rank, interleave) for s in seq]
        assert batch.dcp_local_seq_lens[: len(seq)].tolist() == local
        assert batch.dcp_local_seq_lens_np[: len(seq)].tolist() == local
        assert batch.dcp_local_seq_lens[len(seq):].tolist() == [0] * (pad_rows - len(seq))
    else:
        assert batch.dcp_local_seq_lens is None
    # rows of the batch gather their own block-table rows, host twin included
    for i, (slot, _, _) in enumerate(expect):
        assert torch.equal(batch.block_tables[1][i], tables.block_tables[1][slot])
        assert (tables.input_block_tables_cpu[1][i].numpy() == tables.host_block_tables[1, slot]).all()


def test_padding_rows_never_change_real_outputs():
    """The same real rows with and without CUDA-graph padding give the same inputs, and the
    TORCH_MLA decode (the reference backend) gives the same outputs for the real tokens."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAImpl, TorchMLAMetadataBuilder
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    k = 3
    states, tables, rows, counts, drafts, samples, host_ids, _ = random_batch(5, k, 1, 0, 1)
    keep = [i for i, h in enumerate(host_ids) if h is None]  # decode rows only
    rows, counts, drafts, samples, host_ids = ([xs[i] for i in keep] for xs in
                                               (rows, counts, drafts, samples, host_ids))
    torch.manual_seed(0)
    cache = torch.randn(200, BLOCK, 576, dtype=torch.float64)
    q_all = torch.randn(MAX_TOKENS, 4, 576, dtype=torch.float64)
    outs = []
    for pad in (0, 5):
        builder = InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k)
        B = len(rows)
        batch = builder.build(rows, counts, drafts, samples, host_ids, states, tables,
                              num_reqs_padded=B + pad, num_tokens_padded=sum(counts) + 4 * pad)
        spec = MLAAttentionSpec(block_size=BLOCK, dtype=torch.float64)
        mla = TorchMLAMetadataBuilder(spec, ["l"], VllmConfig(parallel_config=ParallelConfig()),
                                      "cpu", dcp_rank=0)
        mla.reorder_batch_threshold = 1 + k  # verify rows take the decode path (as the runner sets)
        cm = CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc, query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens=batch.seq_lens, num_reqs=B + pad, num_actual_tokens=batch.num_tokens_padded,
            max_query_len=max(counts), max_seq_len=400, block_table_tensor=batch.block_tables[0],
            slot_mapping=batch.slot_mappings[0], seq_lens_cpu=torch.from_numpy(batch.seq_lens_np))
        md = mla.build(0, cm)
        assert md.num_decode_tokens == batch.num_tokens_padded  # padded total (upstream)
        T = batch.num_tokens
        out, lse = TorchMLAImpl(num_heads=4, scale=0.05).forward_decode(
            q_all[: batch.num_tokens_padded], cache, md.decode)
        if pad:
            assert out[T:].abs().max() == 0 and torch.isinf(lse[T:]).all()
        outs.append((batch.input_ids[:T].clone(), batch.positions[:T].clone(), out[:T], lse[:T]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_num_decode_tokens_counts_the_padded_total():
    """Upstream's case: query_start_loc [0, 8, 16, 16] with 24 tokens -> 24 decode tokens."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    qsl = torch.tensor([0, 8, 16, 16], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([20, 30, 0], dtype=torch.int32), num_reqs=3, num_actual_tokens=24,
        max_query_len=8, max_seq_len=30,
        block_table_tensor=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.full((24,), -1, dtype=torch.int64))
    builder = TorchMLAMetadataBuilder(MLAAttentionSpec(block_size=16, dtype=torch.float32), ["l"],
                                      VllmConfig(parallel_config=ParallelConfig()), "cpu",
                                      dcp_rank=0)
    builder.reorder_batch_threshold = 8
    md = builder.build(0, cm)
    assert md.num_decodes == 3 and md.num_decode_tokens == 24 and md.num_prefills == 0


@pytest.mark.slow
def test_triton_input_prep_equals_torch_under_interpreter():
    """The Triton input-preparation kernel (CUDA path), run by Triton's CPU interpreter, writes
    exactly what the torch path writes (ids, positions, seq_lens, logits indices, padding)."""
    from pathlib import Path
    run_interpreter_driver(Path(__file__).parents[2].joinpath(
        "utils", "triton_input_batch_interpret_driver.py"))


@pytest.mark.parametrize("k", [0, 3])
def test_a_reused_builder_equals_a_fresh_one_every_step(k):
    """The packed staging and the block-table gather keep state between steps: one builder
    reused over a sequence of different batches (sizes, prefills, padding, a steady step with a
    new block) must give what a fresh builder gives for each."""
    reused = InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k)
    for seed in range(6):
        states, tables, rows, counts, drafts, samples, host_ids, _ = random_batch(seed, k, 1, 0, 1)
        for step in range(2):
            if step:  # the next steady step: every decode row advanced, one gained a block
                for state, count in zip(rows, counts):
                    states.set_num_computed(state, state.num_computed_tokens + count)
                tables.append_block_ids(rows[0].slot, ([199], [198]), overwrite=False)
            pad = seed % 3
            kw = dict(num_reqs_padded=len(rows) + pad, num_tokens_padded=sum(counts) + 2 * pad)
            got = reused.build(rows, counts, drafts, samples, host_ids, states, tables, **kw)
            got = [t.clone() for t in (got.input_ids, got.positions, got.seq_lens,
                                       got.logits_indices, got.query_start_loc,
                                       got.idx_mapping, got.slot_mappings,
                                       *got.block_tables)]
            fresh_builder = InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k)
            want = fresh_builder.build(rows, counts, drafts, samples, host_ids, states, tables,
                                       **kw)
            want = [want.input_ids, want.positions, want.seq_lens, want.logits_indices,
                    want.query_start_loc, want.idx_mapping, want.slot_mappings,
                    *want.block_tables]
            for a, b in zip(got, want):
                assert torch.equal(a, b), (seed, step)
