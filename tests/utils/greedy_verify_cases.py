"""Random ragged greedy-verification cases (vllm/v1/sample/ops/greedy_verify.py): batch rows
with 0..k drafts, rows that do not sample (no logits rows), a subset of sampling rows, drafts
made right for a random prefix so that every acceptance length occurs."""
from __future__ import annotations

import numpy as np
import torch


def random_greedy_verify_case(seed: int, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rint(lo, hi):  # [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    k, max_slots, vocab = rint(1, 6), 24, rint(3, 50)
    B = rint(1, 12)
    slots_np = torch.randperm(max_slots, generator=gen)[:B].numpy().astype(np.int64)
    # per batch row: logits rows (0: does not sample, 1: samples without drafts, n+1: n drafts)
    n_logits = np.array([[0, 1, rint(2, k + 1)][rint(0, 2)] for _ in range(B)], dtype=np.int64)
    if not n_logits.any():
        n_logits[rint(0, B - 1)] = rint(1, k + 1)
    cu_np = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(n_logits, out=cu_np[1:])
    rows_np = np.flatnonzero(n_logits > 0).astype(np.int64)
    N = int(cu_np[-1])
    # small vocabularies make ties likely: argmax tie-breaking is shared by both paths
    logits = torch.randn(N, vocab, generator=gen)
    if seed % 3 == 0:
        logits = logits.round()
    greedy = logits.argmax(-1)
    draft_tokens = torch.randint(0, vocab, (max_slots, k), generator=gen)
    for r in rows_np:
        n = int(n_logits[r] - 1)
        right = rint(0, n)
        draft_tokens[slots_np[r], :right] = greedy[cu_np[r]:cu_np[r] + right]
    # int32 like the staging buffer; the rows tensor may be longer than the sampling rows
    cu = torch.from_numpy(cu_np.astype(np.int32))
    rows = torch.from_numpy(np.concatenate([rows_np, np.zeros(rint(0, 3), dtype=np.int64)]))
    return {"logits": logits.to(device), "cu": cu.to(device),
            "slots": torch.from_numpy(slots_np).to(device), "rows": rows.to(device),
            "draft_tokens": draft_tokens.to(device),
            "last_sampled": torch.full((max_slots + 1,), -5, dtype=torch.int64, device=device),
            "out": torch.full((max_slots, k + 2), -9, dtype=torch.int64, device=device),
            "cu_np": cu_np, "rows_np": rows_np, "slots_np": slots_np}
