"""Runs the fused step-preparation Triton kernel of InputBatchBuilder (prepare_step.py) on CPU
tensors under TRITON_INTERPRET=1 and compares every buffer it writes with the torch twin
(launched by test_input_batch.py): ids, positions, seq_lens, DCP-local lengths, logits indices,
slot mappings of both groups, the batch-order block tables -- over two steps of one builder, the
second after a block append and a row swap (the refresh flags select rows); then the kernel
alone against the twin on the random cases of the GPU test (tests/utils/prepare_step_cases.py)."""
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.input_batch_cases import MAX_REQS, MAX_TOKENS, random_batch  # noqa: E402
from tests.utils.prepare_step_cases import outputs, random_prep_case  # noqa: E402
from vllm.v1.worker.gpu import input_batch  # noqa: E402
from vllm.v1.worker.gpu.prepare_step import prepare_step_torch, prepare_step_triton  # noqa: E402


def _snapshot(builder, batch, tables):
    buf = builder.buffers
    return [buf.input_ids.clone(), buf.positions.clone(), buf.seq_lens.clone(),
            buf.dcp_local_seq_lens.clone(), builder.logits_indices[:batch.num_logits].clone(),
            tables.slot_mappings[:, :batch.num_tokens_padded].clone(),
            tables._input_block_tables[:, :batch.num_reqs_padded].clone()]


def main() -> None:
    if not input_batch.HAS_TRITON:
        print("NO_TRITON")
        return
    for seed in range(8):
        k = [0, 1, 3, 7][seed % 4]
        dcp, interleave = [(1, 1), (2, 4), (4, 1)][seed % 3]
        results = []
        for use_triton in (False, True):
            states, tables, rows, counts, drafts, samples, host_ids, _ = random_batch(
                seed, k, dcp, seed % dcp, interleave)
            builder = input_batch.InputBatchBuilder(MAX_REQS, MAX_TOKENS, torch.device("cpu"), k,
                                                    dcp, seed % dcp, interleave)
            builder.use_triton = use_triton
            for t in (builder.buffers.input_ids, builder.buffers.positions,
                      builder.buffers.seq_lens, builder.buffers.dcp_local_seq_lens,
                      tables.slot_mappings, tables._input_block_tables):
                t.fill_(-7)
            pad = seed % 3
            snaps = []
            for step in range(2):
                if step:  # a block appended to one row, two rows swapped: refresh flags differ
                    tables.append_block_ids(rows[0].slot, ([199], [198]), overwrite=False)
                    if len(rows) > 1 and host_ids[0] is None and host_ids[1] is None:
                        rows[0], rows[1] = rows[1], rows[0]
                        counts[0], counts[1] = counts[1], counts[0]
                        drafts[0], drafts[1] = drafts[1], drafts[0]
                batch = builder.build(rows, counts, drafts, samples, host_ids, states, tables,
                                      num_reqs_padded=len(rows) + pad,
                                      num_tokens_padded=sum(counts) + 2 * pad)
                snaps += _snapshot(builder, batch, tables)
            results.append(snaps)
        for i, (ref, got) in enumerate(zip(*results)):
            assert torch.equal(ref, got), (seed, i, ref, got)
    # the kernel alone against its twin on the GPU test's random cases (groups, replicated
    # groups, out-of-table positions)
    for seed in range(24):
        ref, args = random_prep_case(seed, "cpu")
        got, _ = random_prep_case(seed, "cpu")
        prepare_step_torch(ref, **args)
        args.pop("num_logits")
        prepare_step_triton(got, **args)
        for i, (a, b) in enumerate(zip(outputs(ref), outputs(got))):
            assert torch.equal(a, b), ("case", seed, i, a, b)
    print("TRITON_INTERPRET_OK")


if __name__ == "__main__":
    sys.exit(main())
