"""Random inputs of the fused step preparation (vllm/v1/worker/gpu/prepare_step.py) on any
device, for comparing the Triton kernel with its torch twin (GPU test, interpreter driver):
decode and prefill rows, padding rows and tail tokens, DCP geometries, sharded and replicated
groups, refresh flags, deferred table writes (patches), positions past a table (PAD)."""
from __future__ import annotations

import numpy as np
import torch

from vllm.v1.worker.gpu.prepare_step import StepPrepBuffers

MAX_ROWS, MAX_TOKENS, SLOTS, COLS, MAX_PATCHES = 16, 512, 16, 24, 64


def random_prep_case(seed: int, device) -> tuple[StepPrepBuffers, dict]:
    g = np.random.default_rng(seed)
    cp_size = int(g.choice([1, 2, 4]))
    interleave = int(g.choice([1, 2, 4]))
    cp_rank = int(g.integers(0, cp_size))
    groups = int(g.integers(1, 3))
    block_sizes = [int(g.choice([16, 32])) for _ in range(groups)]
    group_cp = [cp_size if g.random() < 0.7 else 1 for _ in range(groups)]
    max_blocks = [int(g.integers(COLS // 2, COLS + 1)) for _ in range(groups)]
    k = int(g.integers(1, 8))
    B = int(g.integers(0, 11))
    B_pad = min(B + int(g.integers(0, 4)), MAX_ROWS)
    counts, prefill, computed, logits = [], [], [], []
    for _ in range(B):
        is_prefill = g.random() < 0.3
        count = int(g.integers(1, 41)) if is_prefill else int(g.integers(1, k + 2))
        counts.append(count)
        prefill.append(is_prefill)
        # mostly inside the table; some positions run past it (the kernel stores PAD there)
        computed.append(int(g.integers(0, 700 if g.random() < 0.9 else 3000)))
        logits.append(int(g.integers(0, count + 1)))
    counts += [0] * (B_pad - B)
    qsl = np.zeros(MAX_ROWS + 1, np.int32)
    qsl[1:B_pad + 1] = np.cumsum(counts)
    T = int(qsl[B_pad])
    T_pad = min(T + int(g.integers(0, 9)), MAX_TOKENS)
    cu = np.zeros(MAX_ROWS + 1, np.int32)
    cu[1:B + 1] = np.cumsum(logits)

    def t(a, dtype):
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=device).contiguous()

    def rows(values, fill, dtype):
        out = np.full(MAX_ROWS, fill)
        out[:len(values)] = values
        return t(out, dtype)

    idx = list(g.integers(0, SLOTS, B)) + [0] * (B_pad - B)
    # deferred table writes: unique sorted cell keys (slot-major), some on batch slots
    cells = groups * COLS
    num_patches = int(g.integers(0, 40)) if g.random() < 0.7 else 0
    keys = np.sort(g.choice(SLOTS * cells, num_patches, replace=False))
    patch_keys = np.zeros(MAX_PATCHES, np.int64)
    patch_keys[:num_patches] = keys
    first = np.asarray(idx + [0] * (MAX_ROWS - B_pad), np.int64) * cells
    live = np.arange(MAX_ROWS) < B_pad
    if num_patches <= 16 and g.random() < 0.5:
        # InputBatchBuilder's few-patch ranges: every row scans all of them (a patch of another
        # slot must change nothing)
        lo, hi = np.zeros(MAX_ROWS, np.int64), np.where(live, num_patches, 0)
    else:  # each row's own patches
        lo = np.where(live, np.searchsorted(keys, first), 0)
        hi = np.where(live, np.searchsorted(keys, first + cells), 0)
    bufs = StepPrepBuffers(
        input_ids=t(np.full(MAX_TOKENS, -9), torch.int64),
        positions=t(np.full(MAX_TOKENS, -9), torch.int64),
        seq_lens=t(np.full(MAX_ROWS, -9), torch.int32),
        logits_indices=t(np.full(MAX_TOKENS, -9), torch.int64),
        dcp_local_seq_lens=t(np.full(MAX_ROWS, -9), torch.int32),
        slot_mappings=t(np.full((groups, MAX_TOKENS), -9), torch.int64),
        input_tables=t(np.full((groups, MAX_ROWS, COLS), -9), torch.int32),
        query_start_loc=t(qsl, torch.int32),
        idx_mapping=rows(idx, 0, torch.int64),
        is_prefill=rows(prefill, False, torch.bool),
        prefill_ids=t(g.integers(0, 250, MAX_TOKENS), torch.int64),
        cu_num_logits=t(cu, torch.int32),
        num_computed=rows(computed, 0, torch.int32),
        refresh=rows(g.random(B_pad) < 0.6, False, torch.bool),
        patch_keys=t(patch_keys, torch.int64),
        patch_values=t(g.integers(1000, 2000, MAX_PATCHES), torch.int32),
        patch_lo=t(lo, torch.int32), patch_hi=t(hi, torch.int32),
        last_sampled=t(g.integers(0, 250, SLOTS + 1), torch.int64),
        draft_tokens=t(g.integers(0, 250, (SLOTS, k)), torch.int64),
        tables=t(g.integers(0, 1000, (groups, SLOTS, COLS)), torch.int32),
        block_sizes=t(block_sizes, torch.int32), group_cp_sizes=t(group_cp, torch.int32),
        group_max_blocks=t(max_blocks, torch.int32), block_sizes_host=tuple(block_sizes),
        group_cp_sizes_host=tuple(group_cp), group_max_blocks_host=tuple(max_blocks))
    args = dict(num_reqs=B, num_rows=B_pad, num_tokens_padded=T_pad, cp_size=cp_size,
                cp_rank=cp_rank, cp_interleave=interleave, num_logits=int(cu[B]), num_patches=num_patches)
    return bufs, args


def outputs(b: StepPrepBuffers) -> list[torch.Tensor]:
    """Everything the preparation writes (the slot-indexed tables receive the patches)."""
    return [b.input_ids, b.positions, b.seq_lens, b.logits_indices, b.dcp_local_seq_lens,
            b.slot_mappings, b.input_tables, b.tables]
