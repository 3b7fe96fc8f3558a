"""gather_block_tables skips work that is identical to the previous step (the same slots in the
same rows, no block change). Every change that must invalidate it -- a new block appended, a slot
replaced, rows reordered, a different batch size, a request removed and re-admitted, a gather
without host slots -- is checked against a fresh BlockTables that replays the same history and
gathers once (brute force), on the host twin and the device rows, whole rows compared, and the
pages each gathered row holds (input_num_blocks_cpu) against a count of the history."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.worker.gpu import block_table as block_table_mod
from vllm.v1.worker.gpu.block_table import BlockTables

MAX_REQS, MAX_BLOCKS = 8, 6


class _Twin:
    """A BlockTables under test plus the history needed to rebuild it from scratch."""

    def __init__(self, groups=2):
        self.groups = groups
        self.history: list[tuple] = []
        self.tables = self._new()

    def _new(self) -> BlockTables:
        return BlockTables([4] * self.groups, MAX_REQS, MAX_BLOCKS, 64, "cpu")

    def append(self, slot, ids, overwrite=False):
        self.history.append(("append", slot, ids, overwrite))
        self.tables.append_block_ids(slot, (ids,) * self.groups, overwrite=overwrite)

    def remove(self, slot):
        self.history.append(("remove", slot))
        self.tables.remove_request(slot)

    def check(self, slots, with_np=True):
        idx = torch.tensor(slots, dtype=torch.int64)
        got = self.tables.gather_block_tables(idx, np.asarray(slots, np.int64) if with_np
                                              else None)
        fresh = self._new()
        for op in self.history:
            if op[0] == "append":
                fresh.append_block_ids(op[1], (op[2],) * self.groups, overwrite=op[3])
            else:
                fresh.remove_request(op[1])
        want = fresh.gather_block_tables(idx, np.asarray(slots, np.int64))
        n = len(slots)
        for g in range(self.groups):
            assert torch.equal(got[g], want[g]), (g, slots, got[g], want[g])
            if with_np:
                assert torch.equal(self.tables.input_block_tables_cpu[g][:n],
                                   fresh.input_block_tables_cpu[g][:n]), (g, slots)
                # the pages each gathered row holds, counted from the history itself
                assert self.tables.input_num_blocks_cpu[g][:n].tolist() == [
                    self._held_pages(slot) for slot in slots], (g, slots)

    def _held_pages(self, slot) -> int:
        count = 0
        for op in self.history:
            if op[1] == slot:
                count = 0 if op[0] == "remove" else (0 if op[3] else count) + len(op[2])
        return count


@pytest.fixture(params=["whole", "rows"])
def twin(request, monkeypatch):
    # "rows": the long-table path that re-copies only changed rows
    if request.param == "rows":
        monkeypatch.setattr(block_table_mod, "_FULL_REGATHER_ENTRIES", 0)
    t = _Twin()
    for slot in range(5):
        t.append(slot, [10 * slot + 1, 10 * slot + 2])
    return t


def test_each_invalidating_change_matches_a_fresh_build(twin):
    twin.check([0, 1, 2])
    twin.check([0, 1, 2])                 # unchanged: skipped, still equal
    twin.append(1, [99])                  # a new block appended to a gathered row
    twin.check([0, 1, 2])
    twin.check([0, 3, 2])                 # a slot replaced
    twin.check([2, 0, 3])                 # rows reordered
    twin.check([2, 0, 3, 4])              # a larger batch
    twin.check([2, 0])                    # a smaller batch
    twin.append(3, [77])                  # a change to a slot outside the batch ...
    twin.check([2, 0])
    twin.check([2, 0, 3])                 # ... seen when it comes back
    twin.remove(0)                        # removed and re-admitted in the same slot
    twin.append(0, [55, 56, 57], overwrite=True)
    twin.check([2, 0, 3])
    twin.check([2, 0, 3, 0, 0])           # graph padding rows repeat slot 0
    twin.append(0, [58])
    twin.check([2, 0, 3, 0, 0])
    twin.check([2, 0, 3], with_np=False)  # device-only gather: forget what the host holds
    twin.append(2, [66])
    twin.check([2, 0, 3])


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_match_fresh_builds(seed, monkeypatch):
    gen = np.random.default_rng(seed)
    if seed % 2:
        monkeypatch.setattr(block_table_mod, "_FULL_REGATHER_ENTRIES", 0)
    twin = _Twin(groups=1 + seed % 2)
    counts = [0] * MAX_REQS
    slots = [0, 1, 2]
    for slot in range(MAX_REQS):
        twin.append(slot, [int(gen.integers(1, 500))])
        counts[slot] = 1
    for _ in range(60):
        op = gen.integers(0, 6)
        if op == 0:  # steady: some rows grow by a block
            for slot in slots:
                if counts[slot] < MAX_BLOCKS and gen.random() < 0.3:
                    twin.append(slot, [int(gen.integers(1, 500))])
                    counts[slot] += 1
        elif op == 1:  # a new batch composition
            slots = gen.choice(MAX_REQS, int(gen.integers(1, MAX_REQS + 1)),
                               replace=False).tolist()
        elif op == 2 and len(slots) > 1:
            slots = gen.permutation(slots).tolist()
        elif op == 3:  # preempted and re-admitted
            slot = int(gen.integers(0, MAX_REQS))
            twin.remove(slot)
            twin.append(slot, [int(gen.integers(1, 500))], overwrite=True)
            counts[slot] = 1
        pad = min(int(gen.integers(0, 3)), MAX_REQS - len(slots))
        twin.check(slots + [0] * pad)
