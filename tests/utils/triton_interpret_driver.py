"""Runs the CUDA Triton kernels of cp_utils / block_table on CPU tensors under TRITON_INTERPRET=1
and compares them with the torch paths. Launched in a subprocess by test_triton_interpreter.py
(the interpreter must be chosen before the kernels are decorated, i.e. at import time)."""
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from vllm.v1.worker.gpu import cp_utils  # noqa: E402
from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402


def check_prepare(gen):
    for trial in range(30):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        seq_lens = torch.randint(0, 5000, (n,), generator=gen, dtype=torch.int32)
        cp_size = int(torch.randint(1, 9, (1,), generator=gen))
        rank = int(torch.randint(0, cp_size, (1,), generator=gen))
        interleave = [1, 2, 4, 16][trial % 4]
        num_reqs = int(torch.randint(0, n + 1, (1,), generator=gen))
        ref = torch.full((n,), 9, dtype=torch.int32)
        got = torch.full((n,), 9, dtype=torch.int32)
        cp_utils._prepare_torch(ref, seq_lens, num_reqs, cp_size, rank, interleave)
        cp_utils._prepare_triton(got, seq_lens, num_reqs, cp_size, rank, interleave)
        assert torch.equal(ref, got), (trial, ref, got)


def check_slot_mappings(gen):
    for trial in range(24):
        cp_size = [1, 2, 4, 8][trial % 4]
        interleave = [1, 2, 4][(trial // 4) % 3]
        block_size = [4, 8, 16][trial % 3]
        rank = int(torch.randint(0, cp_size, (1,), generator=gen))
        # Half the trials pair a sharded group with a replicated one (non-DCP drafter).
        sharded = [True, True] if trial < 12 else [trial % 2 == 0, trial % 2 == 1]
        bt = BlockTables([block_size, block_size], 8, 6, 1024, "cpu", cp_size, rank, interleave,
                         dcp_sharded=sharded)
        for slot in range(8):
            ids = torch.randperm(100, generator=gen)[:6].tolist()
            bt.append_block_ids(slot, (ids, ids[::-1]), overwrite=True)
        num_reqs = int(torch.randint(0, 7, (1,), generator=gen))
        qsl, positions = [0], []
        for _ in range(num_reqs):
            L = int(torch.randint(1, 6 * block_size * cp_size + 1, (1,), generator=gen))
            q = int(torch.randint(0, min(L, 300) + 1, (1,), generator=gen))
            positions += list(range(L - q, L))
            qsl.append(qsl[-1] + q)
        positions += [0] * int(torch.randint(0, 4, (1,), generator=gen))
        bt.gather_block_tables(torch.randperm(8, generator=gen)[:num_reqs])
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        bt.slot_mappings.fill_(123)
        bt._compute_slot_mappings_torch(qsl_t, pos_t, num_reqs, len(positions))
        ref = bt.slot_mappings.clone()
        bt.slot_mappings.fill_(123)
        bt._compute_slot_mappings_triton(qsl_t, pos_t, num_reqs, len(positions))
        assert torch.equal(ref, bt.slot_mappings), (trial, cp_size, interleave, block_size)


def check_out_of_table_positions_become_pad():
    bt = BlockTables([4], 2, 2, 16, "cpu", 2, 0, 1)
    bt.append_block_ids(0, ([5, 6],), overwrite=False)
    bt.gather_block_tables(torch.tensor([0]))
    # 2 virtual blocks of 8 tokens: position 16 is past the table; rank 0 owns even offsets.
    bt._compute_slot_mappings_triton(torch.tensor([0, 3], dtype=torch.int32),
                                     torch.tensor([2, 16, -2]), 1, 3)
    assert bt.slot_mappings[0, :3].tolist() == [5 * 4 + 1, -1, -1], bt.slot_mappings


if __name__ == "__main__":
    if not cp_utils.HAS_TRITON:
        print("NO_TRITON")
        sys.exit(0)
    generator = torch.Generator().manual_seed(0)
    check_prepare(generator)
    check_slot_mappings(generator)
    check_out_of_table_positions_become_pad()
    print("TRITON_INTERPRET_OK")
