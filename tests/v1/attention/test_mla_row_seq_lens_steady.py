"""Steady plain decode, and steady uniform blocks (causal verify blocks without DCP, non-causal
draft blocks with or without it), write only the live rows' lengths into the persistent row
buffers; every step's row geometry still equals a brute-force walk over the rows, whatever came
before it.

The shortcuts (MLACommonMetadataBuilder._row_seq_lens) keep req, pos and the zero tail of the
padding tokens from the last full write of the same layout. The oracle recomputes every token
from scratch: its row, its index in the row, and what it sees (the caller's rank-local length
for a row's last token, local(G - (Q-1-j)) from the global bound for the earlier rows of a
causal block, 0 for padding tokens).
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.utils.mla_dcp_helpers import mla_spec, parallel_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder
from vllm.v1.worker.gpu.cp_utils import get_dcp_local_seq_lens


def _local(g: int, dcp: int, rank: int, inter: int) -> int:
    return int(get_dcp_local_seq_lens(torch.tensor([g]), dcp, rank, inter)[0])


def _oracle(q_lens, glob, local, num_tokens, dcp, rank, inter):
    out, req, pos = [], [], []
    starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
    for t in range(num_tokens):
        rows = [b for b in range(len(q_lens)) if starts[b] <= t < starts[b] + q_lens[b]]
        if not rows:  # padding token: the last block's index, sees nothing
            b = len(q_lens) - 1
            out.append(0)
            req.append(b)
            pos.append(t - starts[b])
            continue
        b = rows[0]
        j, q = t - starts[b], q_lens[b]
        seen = local[b] if j == q - 1 else _local(glob[b] - (q - 1 - j), dcp, rank, inter)
        out.append(seen)
        req.append(b)
        pos.append(j)
    return out, req, pos


def _metadata(q_lens, glob, extra_tokens, dcp, rank, inter, causal):
    """The step's CommonAttentionMetadata for rows of `q_lens` tokens (lengths from `glob`),
    with `extra_tokens` padding tokens past the last row; also (qsl, seq, local) lists."""
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1] + extra_tokens
    seq = glob[: len(q_lens)]
    local = [_local(g, dcp, rank, inter) for g in seq]
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    local_t = torch.tensor(local, dtype=torch.int32) if dcp > 1 else None
    cm = CommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t,
        seq_lens=torch.tensor(seq, dtype=torch.int32), num_reqs=len(q_lens),
        num_actual_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq),
        block_table_tensor=torch.zeros(len(q_lens), 32, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        dcp_local_seq_lens=local_t, seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        dcp_local_seq_lens_cpu=None if local_t is None else local_t.clone(), causal=causal)
    return cm, qsl, seq, local


def _counting_builder(monkeypatch, non_causal: bool, dcp: int, inter: int, rank: int):
    """A torch MLA builder of one group and the list its full row writes append to (a step
    that takes a shortcut appends nothing)."""
    builder = TorchMLAMetadataBuilder(mla_spec(16, non_causal), ["l0"],
                                      parallel_config(dcp, inter), "cpu", dcp_rank=rank)
    full_writes = []
    original = TorchMLAMetadataBuilder._row_seq_lens_torch

    def counted(self, *args, **kwargs):
        full_writes.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TorchMLAMetadataBuilder, "_row_seq_lens_torch", counted)
    return builder, full_writes


@pytest.mark.parametrize("seed", range(6))
def test_steady_rows_equal_brute_force_across_layout_changes(seed, monkeypatch):
    rng = random.Random(seed)
    dcp, inter = rng.choice([(1, 1), (2, 1), (2, 4)])
    rank = rng.randrange(dcp)
    b, full_writes = _counting_builder(monkeypatch, False, dcp, inter, rank)
    b.reorder_batch_threshold = 4
    live, pad, extra, steps = rng.randint(1, 6), 0, 0, 60
    hits, previous = 0, None
    glob = [rng.randint(5, 300) for _ in range(16)]
    for step in range(steps):
        event, q = rng.random(), 1
        if event < 0.08:
            live = max(1, min(10, live + rng.choice([-1, 1])))  # a request joins or leaves
        elif event < 0.14:
            pad = rng.randint(0, 3)  # other CUDA-graph padding rows (and tokens)
            extra = rng.choice([0, 0, 1, 2])
        elif event < 0.2 or (previous is not None and previous[0][0] == 3 and event < 0.5):
            q = 3  # a verify step between plain steps (often a run of them)
        glob = [g + rng.choice([1, 1, 2]) for g in glob]
        prefill = rng.random() < 0.1  # a mixed step: a prompt chunk after the decode rows
        q_lens = [q] * live + ([6] if prefill else [0] * pad)
        extra_tokens = extra if q == 1 and not prefill else 0
        cm, qsl, seq, local = _metadata(q_lens, glob, extra_tokens, dcp, rank, inter, True)
        num_tokens = qsl[-1] + extra_tokens
        md = b.build(0, cm)
        decode = md.decode
        dec_lens = q_lens[:live] if prefill else q_lens
        assert md.num_prefills == int(prefill) and md.num_decodes == len(dec_lens)
        assert md.num_decode_tokens == (qsl[live] if prefill else max(qsl[-1], num_tokens))
        assert decode.query_start_loc_cpu.tolist() == qsl[: len(dec_lens) + 1]
        assert decode.max_query_len == q
        want = _oracle(dec_lens, seq, local, decode.num_decode_tokens, dcp, rank, inter)
        assert decode.row_seq_lens.tolist() == want[0], (step, q_lens)
        assert decode.row_req.tolist() == want[1], (step, q_lens)
        assert decode.row_pos.tolist() == want[2], (step, q_lens)
        assert decode.row_seq_lens_cpu.tolist() == want[0]
        layout = (tuple(dec_lens), decode.num_decode_tokens)
        # plain rows laid out as in the last step; causal blocks (verify) likewise without DCP
        hits += layout == previous and (q == 1 or dcp == 1)
        previous = layout
    # the shortcuts are taken exactly on the steps that repeat the last layout
    assert hits >= 10 and len(full_writes) == steps - hits


@pytest.mark.parametrize("seed", range(4))
def test_steady_non_causal_blocks_equal_brute_force(seed, monkeypatch):
    # A block drafter's draft group: every row of a live block sees its request's whole
    # rank-local length, under DCP too; padding rows see nothing. Steps that repeat the last
    # layout take the shortcut, whatever the DCP size.
    rng = random.Random(100 + seed)
    dcp, inter = rng.choice([(1, 1), (2, 1), (4, 16)])
    rank = rng.randrange(dcp)
    b, full_writes = _counting_builder(monkeypatch, True, dcp, inter, rank)
    live, pad, q, steps, hits, previous = rng.randint(1, 5), rng.randint(0, 3), 4, 40, 0, None
    glob = [rng.randint(5, 300) for _ in range(12)]
    for step in range(steps):
        event = rng.random()
        if event < 0.1:
            live = max(1, min(8, live + rng.choice([-1, 1])))
        elif event < 0.2:
            pad = rng.randint(0, 3)
        elif event < 0.25:
            q = rng.choice([3, 4, 5])  # another block size
        glob = [g + rng.randint(1, q) for g in glob]  # accepted drafts move every length
        q_lens = [q] * live + [0] * pad
        cm, qsl, seq, local = _metadata(q_lens, glob, 0, dcp, rank, inter, False)
        decode = b.build(0, cm).decode
        want_out = [local[t // q] if t < live * q else 0 for t in range(decode.num_decode_tokens)]
        assert decode.row_seq_lens.tolist() == want_out, (step, q_lens)
        assert decode.row_req.tolist() == [min(t // q, live - 1) if t < live * q
                                           else len(q_lens) - 1
                                           for t in range(decode.num_decode_tokens)]
        assert decode.row_seq_lens_cpu.tolist() == want_out
        layout = tuple(q_lens)
        hits += layout == previous
        previous = layout
    assert hits >= 15 and len(full_writes) == steps - hits
