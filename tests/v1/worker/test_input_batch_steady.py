"""The builder's state between steps: the steady-shape layout cache (a uniform step of the same
shape reuses the staged layout) and the block-table refresh flags (only rows whose slot or blocks
changed are re-gathered on the device). One builder and one BlockTables live through a random
walk of steps -- steady decode steps, block appends, rows swapped, batch size / padding / query
length changes, prefill rows, requests removed and re-admitted into the same slot, a foreign
gather_block_tables call (a speculator) in between -- and after every build every buffer is
compared with a brute-force host computation from the request state alone (the device tables
receive appended block ids through the step's staged patches, or by direct copies when they do
not fit)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.utils.dcp_oracle import brute_local_len
from tests.utils.input_batch_cases import brute_step_inputs
from vllm.v1.worker.gpu import block_table as block_table_mod
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBatchBuilder
from vllm.v1.worker.gpu.request_states import RequestStates

BLOCK, MAX_REQS, MAX_TOKENS, MAX_BLOCKS = 16, 12, 256, 40


class _World:
    def __init__(self, seed, k, dcp, rank, interleave):
        self.gen = np.random.default_rng(seed)
        self.k, self.dcp, self.rank, self.interleave = k, dcp, rank, interleave
        self.states = RequestStates(MAX_REQS, "cpu", k)
        self.tables = BlockTables([BLOCK, BLOCK], MAX_REQS, MAX_BLOCKS, MAX_TOKENS, "cpu",
                                  cp_size=dcp, cp_rank=rank, cp_interleave=interleave)
        self.builder = InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k, dcp, rank,
                                         interleave)
        self.next_block = 1
        self.n = 0
        self.rows = [self._admit() for _ in range(int(self.gen.integers(1, 7)))]
        self.q = 1 + k

    def _blocks(self, n):
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def _ensure_blocks(self, state, upto):
        have = int(self.tables.num_blocks[0, state.slot])
        need = -(-upto // (BLOCK * self.dcp))
        if need > have:
            new = self._blocks(need - have)
            self.tables.append_block_ids(state.slot, (new, new[::-1]), overwrite=False)

    def _admit(self):
        computed = int(self.gen.integers(1, 120))
        state = self.states.add(f"r{self.n}", [0] * (computed + 1), computed, None)
        self.n += 1
        self.tables.append_block_ids(state.slot, ([], []), overwrite=True)
        self._ensure_blocks(state, computed + 2 * (self.k + 1))
        self._new_tokens(state)
        return state

    def _new_tokens(self, state):
        self.states.last_sampled[state.slot] = int(self.gen.integers(0, 250))
        self.states.draft_tokens[state.slot] = torch.from_numpy(
            self.gen.integers(0, 250, max(self.k, 1)))

    def mutate(self):
        """One random change between steps (or none: a plain steady step)."""
        g = self.gen
        for state in self.rows:  # every row advanced by its last query
            self.states.set_num_computed(state, state.num_computed_tokens + self.q)
            self._ensure_blocks(state, state.num_computed_tokens + 2 * (self.k + 1))
            self._new_tokens(state)
        event = int(g.integers(0, 9))
        if event == 1 and len(self.rows) > 1:
            i, j = g.choice(len(self.rows), 2, replace=False)
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
        elif event == 2 and len(self.rows) < MAX_REQS - 2:
            self.rows.append(self._admit())
        elif event == 3 and len(self.rows) > 1:
            gone = self.rows.pop(int(g.integers(0, len(self.rows))))
            self.states.remove(gone.req_id)
            self.tables.remove_request(gone.slot)
        elif event == 4 and self.rows:
            # removed and re-admitted into the same slot with fresh blocks
            i = int(g.integers(0, len(self.rows)))
            old = self.rows[i]
            self.states.remove(old.req_id)
            self.tables.remove_request(old.slot)
            self.rows[i] = self._admit()
        elif event == 5:
            # a speculator gathers other rows through the same tables
            other = g.integers(0, MAX_REQS, int(g.integers(1, 5)))
            got = self.tables.gather_block_tables(torch.from_numpy(other), other)
            for grp in range(2):  # it sees every block appended so far (deferred or not)
                assert torch.equal(got[grp], torch.from_numpy(
                    self.tables.host_block_tables[grp, other]))
        elif event == 6 and self.k:
            self.q = int(g.integers(1, self.k + 2))  # another uniform query length
        elif event == 7:
            self.tables.gather_block_tables(torch.zeros(2, dtype=torch.int64))  # no host slots

    def layout(self):
        g = self.gen
        rows = list(self.rows)
        counts = [self.q] * len(rows)
        drafts = [self.q - 1] * len(rows)
        samples = [True] * len(rows)
        host_ids = [None] * len(rows)
        extra = []
        if g.random() < 0.2 and len(rows) < MAX_REQS - 1:
            # a prefill chunk after the decodes (a one-off row: not kept in the walk)
            prompt = g.integers(0, 250, int(g.integers(2, 30))).tolist()
            computed = int(g.integers(0, len(prompt) - 1))
            count = int(g.integers(1, len(prompt) - computed + 1))
            state = self.states.add(f"p{self.n}", prompt, computed, None)
            self.n += 1
            self.tables.append_block_ids(state.slot, (self._blocks(3), self._blocks(3)),
                                         overwrite=True)
            rows.append(state); counts.append(count); drafts.append(0)
            samples.append(computed + count == len(prompt))
            host_ids.append(prompt[computed:computed + count])
            extra.append(state)
        return rows, counts, drafts, samples, host_ids, extra

    def drop(self, extra):
        for state in extra:
            self.states.remove(state.req_id)
            self.tables.remove_request(state.slot)


def _check(world, batch, rows, counts, drafts, samples, host_ids, pad_rows, pad_tokens):
    states, tables = world.states, world.tables
    dcp, rank, interleave = world.dcp, world.rank, world.interleave
    expect = []
    for state, count, n_drafts, host in zip(rows, counts, drafts, host_ids):
        computed = int(states.num_computed.np[state.slot])
        if host is None:
            row_ids = [int(states.last_sampled[state.slot])] + \
                states.draft_tokens[state.slot, :n_drafts].tolist()
        else:
            row_ids = host
        expect.append((state.slot, computed, row_ids, count, n_drafts))
    ids, pos, seq, logits, slots = brute_step_inputs(
        [(*row, sample) for row, sample in zip(expect, samples)], tables.host_block_tables, 2,
        BLOCK, dcp, rank, interleave)
    T, B = len(ids), len(rows)
    assert batch.num_tokens == T and batch.num_tokens_padded == pad_tokens
    assert batch.input_ids.tolist() == ids + [0] * (pad_tokens - T)
    assert batch.positions.tolist() == pos + [0] * (pad_tokens - T)
    assert world.builder.buffers.seq_lens.tolist() == seq + [0] * (MAX_REQS - B)
    assert batch.seq_lens_np.tolist() == seq + [0] * (pad_rows - B)
    assert batch.logits_indices.tolist() == logits
    assert batch.cu_num_logits_np[-1] == len(logits)
    assert batch.num_scheduled_np.tolist() == counts
    assert batch.num_draft_np.tolist() == drafts
    assert batch.samples_np.tolist() == samples
    assert batch.num_computed_np.tolist() == [s - c for s, c in zip(seq, counts)]
    qsl = [0] + np.cumsum(counts).tolist() + [T] * (pad_rows - B)
    assert batch.query_start_loc.tolist() == qsl and batch.query_start_loc_np.tolist() == qsl
    for grp in range(2):
        assert batch.slot_mappings[grp].tolist() == slots[grp] + [-1] * (pad_tokens - T)
        # every row (padding rows read slot 0) holds its slot's whole table row, on both sides
        row_slots = [r.slot for r in rows] + [0] * (pad_rows - B)
        want = torch.from_numpy(tables.host_block_tables[grp, row_slots])
        assert torch.equal(batch.block_tables[grp], want)
        assert torch.equal(tables.input_block_tables_cpu[grp][:pad_rows], want)
    local = [brute_local_len(s, dcp, rank, interleave) for s in seq]
    if dcp > 1:
        assert world.builder.buffers.dcp_local_seq_lens.tolist() == local + [0] * (MAX_REQS - B)
        assert batch.dcp_local_seq_lens_np.tolist() == local + [0] * (pad_rows - B)
    uniform = all(h is None for h in host_ids) and len(set(counts)) == 1 and all(samples)
    assert batch.uniform_query_len == (counts[0] if uniform else 0)


@pytest.fixture(params=["whole-staged", "rows-staged", "rows-flushed"])
def regather(request, monkeypatch):
    # both host re-gather strategies of gather_host (whole batch / changed rows only), and the
    # appended block ids staged as patches of the fused preparation or (no room) copied directly
    monkeypatch.setattr(block_table_mod, "_FULL_REGATHER_ENTRIES",
                        1 << 30 if request.param.startswith("whole") else 0)
    if request.param.endswith("flushed"):
        monkeypatch.setattr(InputBatchBuilder, "MAX_PATCHES_PER_ROW", 0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 4), (4, 1)])
@pytest.mark.parametrize("k", [0, 3])
def test_random_walk_of_steps_equals_brute_force(seed, dcp, interleave, k, regather):
    world = _World(seed * 7 + k, k, dcp, seed % dcp, interleave)
    for step in range(30):
        if step:
            world.mutate()
        rows, counts, drafts, samples, host_ids, extra = world.layout()
        pad = int(world.gen.integers(0, 3)) if world.gen.random() < 0.3 else 0
        pad_rows = min(len(rows) + pad, MAX_REQS)
        pad_tokens = sum(counts) + pad * max(counts)
        # poison every output so a skipped write cannot pass on stale values of its own
        if world.gen.random() < 0.15:
            world.builder.buffers.input_ids.fill_(-3)
            world.tables.slot_mappings.fill_(-5)
        batch = world.builder.build(rows, counts, drafts, samples, host_ids, world.states,
                                    world.tables, num_reqs_padded=pad_rows,
                                    num_tokens_padded=pad_tokens)
        _check(world, batch, rows, counts, drafts, samples, host_ids, pad_rows, pad_tokens)
        world.drop(extra)


def test_steady_step_reuses_the_layout_and_skips_unchanged_rows():
    """Two identical steady steps: the second reuses the cached (read-only) layout arrays and
    flags no block-table row; a block appended to one row flags exactly that row."""
    world = _World(3, 0, 1, 0, 1)
    world.rows = world.rows[:1] + [world._admit() for _ in range(3)]
    B = len(world.rows)

    def step():
        return world.builder.build(list(world.rows), [1] * B, [0] * B, [True] * B, [None] * B,
                                   world.states, world.tables)

    first = step()
    second = step()
    assert second.num_scheduled_np is first.num_scheduled_np  # the cached layout
    with pytest.raises(ValueError):
        second.num_scheduled_np[0] = 5  # read-only: shared by every step of the shape
    assert not world.builder.refresh_rows.np[:B].any()  # nothing changed: nothing re-gathered
    for state in world.rows:
        world.states.set_num_computed(state, state.num_computed_tokens + 1)
    world.tables.append_block_ids(world.rows[2].slot, ([500], [501]), overwrite=False)
    third = step()
    assert world.builder.refresh_rows.np[:B].tolist() == [False, False, True, False]
    _check(world, third, list(world.rows), [1] * B, [0] * B, [True] * B, [None] * B, B, B)
