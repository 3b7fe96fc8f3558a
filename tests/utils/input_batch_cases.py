"""Random InputBatch cases (decode rows with drafts, prefill chunks) for the input-batch tests
and the Triton interpreter driver."""
from __future__ import annotations

import numpy as np
import torch

from tests.utils.dcp_oracle import brute_slots
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.request_states import RequestStates

BLOCK = 16
MAX_REQS, MAX_TOKENS, MAX_BLOCKS = 16, 512, 24


def random_batch(seed: int, k: int, dcp: int, rank: int, interleave: int):
    gen = np.random.default_rng(seed)
    states = RequestStates(MAX_REQS, "cpu", k)
    tables = BlockTables([BLOCK, BLOCK], MAX_REQS, MAX_BLOCKS, MAX_TOKENS, "cpu", cp_size=dcp,
                         cp_rank=rank, cp_interleave=interleave)
    num_reqs = int(gen.integers(1, 9))
    rows, counts, drafts, samples, host_ids = [], [], [], [], []
    expect = []
    for i in range(num_reqs):
        req_id = f"r{i}"
        is_prefill = i >= num_reqs - int(gen.integers(0, 3)) if num_reqs > 1 else False
        if is_prefill:
            prompt = gen.integers(0, 250, int(gen.integers(1, 40))).tolist()
            computed = int(gen.integers(0, len(prompt)))  # partial prefill chunks too
            count = int(gen.integers(1, len(prompt) - computed + 1))
            state = states.add(req_id, prompt, computed, None)
            ids = prompt[computed:computed + count]
            rows.append(state); counts.append(count); drafts.append(0)
            samples.append(computed + count == len(prompt)); host_ids.append(ids)
            expect.append((state.slot, computed, ids))
        else:
            computed = int(gen.integers(1, 300))
            n_drafts = int(gen.integers(0, k + 1))
            state = states.add(req_id, [0] * (computed + 1), computed, None)
            anchor = int(gen.integers(0, 250))
            draft_ids = gen.integers(0, 250, max(k, 1)).tolist()
            states.last_sampled[state.slot] = anchor
            states.draft_tokens[state.slot] = torch.tensor(draft_ids)
            ids = [anchor] + draft_ids[:n_drafts]
            rows.append(state); counts.append(1 + n_drafts); drafts.append(n_drafts)
            samples.append(True); host_ids.append(None)
            expect.append((state.slot, computed, ids))
        blocks = gen.permutation(200)[: -(-(computed + counts[-1] + k + 1) // (BLOCK * dcp))]
        tables.append_block_ids(state.slot, (blocks.tolist(), blocks[::-1].tolist()), overwrite=True)
    # decodes first (what the runner guarantees)
    order = sorted(range(num_reqs), key=lambda j: host_ids[j] is not None)
    pick = lambda xs: [xs[j] for j in order]  # noqa: E731
    return (states, tables, pick(rows), pick(counts), pick(drafts), pick(samples),
            pick(host_ids), pick(expect))




def brute_step_inputs(rows, host_tables, groups, block_size, dcp, rank, interleave):
    """What a step's inputs must be, by brute force on the host. `rows`: per batch row
    (slot, num_computed, input ids, query length, drafts, samples); `host_tables`: the
    [groups, slots, blocks] host block tables. Returns (input ids, positions, seq_lens,
    logits indices, slot mappings per group), concatenated over the rows."""
    ids, pos, seq, logits, slots = [], [], [], [], [[] for _ in range(groups)]
    start = 0
    for slot, computed, row_ids, count, n_drafts, sample in rows:
        ids += row_ids
        row_pos = list(range(computed, computed + count))
        pos += row_pos
        seq.append(computed + count)
        if sample:  # a verified row's logits are all its tokens, a plain row's its last
            n = count if n_drafts else 1
            logits += list(range(start + count - n, start + count))
        for grp in range(groups):
            slots[grp] += brute_slots(row_pos, host_tables[grp, slot].tolist(), block_size,
                                      dcp, rank, interleave)
        start += count
    return ids, pos, seq, logits, slots
