"""Runs the Triton input-preparation kernel of InputBatchBuilder on CPU tensors under
TRITON_INTERPRET=1 and compares it with the torch path (launched by test_input_batch.py)."""
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.input_batch_cases import MAX_REQS, MAX_TOKENS, random_batch  # noqa: E402
from vllm.v1.worker.gpu import input_batch  # noqa: E402


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
            builder.buffers.input_ids.fill_(-7)
            builder.buffers.positions.fill_(-7)
            builder.buffers.seq_lens.fill_(-7)
            pad = seed % 3
            batch = builder.build(rows, counts, drafts, samples, host_ids, states, tables,
                                  num_reqs_padded=len(rows) + pad,
                                  num_tokens_padded=sum(counts) + 2 * pad)
            results.append([batch.input_ids.clone(), batch.positions.clone(),
                            builder.buffers.seq_lens.clone(), batch.logits_indices.clone()])
        for ref, got in zip(*results):
            assert torch.equal(ref, got), (seed, ref, got)
    print("TRITON_INTERPRET_OK")


if __name__ == "__main__":
    sys.exit(main())
