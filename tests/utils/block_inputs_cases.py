"""Random cases of the block drafters' fused input write and a brute-force oracle of what it must
write (per row and token, from the DCP placement rule of DESIGN §2, no torch vectorisation).

Shared by tests/v1/spec_decode/test_block_inputs.py (torch twin) and the Triton-interpreter driver
tests/utils/triton_block_inputs_interpret_driver.py (kernel)."""
from __future__ import annotations

import random

import torch

from vllm.v1.attention.backends.mla.plan_lowering import PlanLowering
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.spec_decode.block_inputs import BlockInputBuffers

SENTINEL = -7  # what every buffer holds before the write: stale values the write must replace


def random_case(seed: int, device: str = "cpu") -> dict:
    rng = random.Random(seed)
    cp_size = rng.choice([1, 2, 4])
    interleave = rng.choice([1, 2, 4])
    block_size = interleave * rng.choice([1, 2, 4])
    cp_rank = rng.randrange(cp_size)
    num_groups = rng.choice([1, 2, 3])
    sharded = [rng.random() < 0.6 for _ in range(num_groups)]
    max_num_reqs, max_blocks = 8, 6
    q = rng.choice([1, 2, 3, 4, 5, 8])
    tables = BlockTables([block_size] * num_groups, max_num_reqs, max_blocks, 256, device,
                         cp_size, cp_rank, interleave, dcp_sharded=sharded)
    for slot in range(max_num_reqs):
        ids = tuple(rng.sample(range(1, 200), max_blocks) for _ in range(num_groups))
        tables.append_block_ids(slot, ids, overwrite=True)
    padded = rng.randint(1, max_num_reqs)
    num_reqs = rng.randint(0, padded)
    slots = rng.sample(range(max_num_reqs), padded)
    tables.gather_block_tables(torch.tensor(slots, device=device))
    capacity = block_size * cp_size * max_blocks  # tokens a row's table covers
    max_model_len = rng.choice([capacity, capacity - rng.randint(0, capacity // 2)])
    # Some rows sit at the end of the context, so their block positions clamp.
    accepted = [rng.choice([rng.randint(0, max_model_len - 1), max_model_len - rng.randint(1, q)])
                for _ in range(num_reqs)]
    accepted = [max(a, 0) for a in accepted]
    anchors = [rng.randrange(1, 1000) for _ in range(num_reqs)]
    # EAGLE/MTP steps: rows of one token starting past the accepted prefix, first ids read from
    # a column of the [num_reqs, k] drafts (a strided view).
    start_offset = rng.choice([0, 0, 1, 3])
    first_ids = torch.tensor(anchors, dtype=torch.int64, device=device)
    if rng.random() < 0.4:
        wide = torch.zeros(num_reqs, 3, dtype=torch.int64, device=device)
        wide[:, 1] = first_ids
        first_ids = wide[:, 1]
    accepted = [max(a - start_offset, 0) for a in accepted]
    group_ids = tuple(sorted(rng.sample(range(num_groups), rng.randint(1, num_groups))))
    # The early draft step's indirections (the runner hands over device state as it lies):
    # start = target seq_len (int32) + emitted tokens (a column of the packed step output) - Q,
    # and the anchor is the last sampled token of the row's request slot.
    accepted_dtype, accepted_extra, next_token_rows = torch.int64, None, None
    if rng.random() < 0.35:
        starts = [a + start_offset for a in accepted]
        emitted = [rng.randint(1, q) for _ in range(num_reqs)]
        start_offset = -q
        accepted = [st - e + q for st, e in zip(starts, emitted)]
        accepted_dtype = torch.int32
        packed = torch.full((num_reqs, q + 1), SENTINEL, dtype=torch.int64, device=device)
        packed[:, -1] = torch.tensor(emitted, dtype=torch.int64)
        accepted_extra = packed[:, -1]
    if rng.random() < 0.35:
        by_slot = torch.full((max_num_reqs + 1,), SENTINEL, dtype=torch.int64, device=device)
        rows = rng.sample(range(max_num_reqs + 1), num_reqs)
        by_slot[torch.tensor(rows, dtype=torch.int64)] = first_ids.clone()
        first_ids = by_slot
        next_token_rows = torch.tensor(rows, dtype=torch.int64, device=device)
    buffers = BlockInputBuffers(
        input_ids=torch.full((256,), SENTINEL, dtype=torch.int64, device=device),
        positions=torch.full((256,), SENTINEL, dtype=torch.int64, device=device),
        seq_lens=torch.full((max_num_reqs,), SENTINEL, dtype=torch.int32, device=device),
        anchors=torch.full((max_num_reqs,), SENTINEL, dtype=torch.int64, device=device),
        group_ids=torch.tensor(group_ids, dtype=torch.int32, device=device),
        group_ids_host=group_ids,
        offsets=torch.arange(q, dtype=torch.int64, device=device))
    tables.slot_mappings.fill_(SENTINEL)
    return dict(tables=tables, buffers=buffers, num_reqs=num_reqs, padded=padded, q=q,
                accepted=torch.tensor(accepted, dtype=accepted_dtype, device=device),
                next_token_ids=first_ids, start_offset=start_offset,
                accepted_extra=accepted_extra, next_token_rows=next_token_rows,
                max_model_len=max_model_len, slots=slots, sharded=sharded)


def _brute_slot(tables: BlockTables, group: int, row: int, pos: int, sharded: bool) -> int:
    """Slot of global position `pos` of batch row `row` in `group` on this rank, or -1: token t
    lives on rank (t // I) % N at local index (t // (I*N)) * I + t % I; a block id covers
    block_size * N global tokens and block_size local ones (N = 1 for a replicated group, whose
    table holds cp_size pages per scheduler block, already expanded)."""
    n = tables.cp_size if sharded else 1
    rank = tables.cp_rank if sharded else 0
    interleave, block_size = tables.cp_interleave, tables.block_sizes[group]
    if (pos // interleave) % n != rank:
        return -1
    local = (pos // (interleave * n)) * interleave + pos % interleave
    page = pos // (block_size * n)
    block_id = int(tables.input_block_tables[group][row, page])
    return block_id * block_size + local % block_size


def expected_writes(case: dict) -> dict:
    """What the write must leave: {name: list} for ids column 0, anchors, positions, seq_lens
    (the first `padded` rows) and the slot rows of every group (groups not drafted keep
    SENTINEL)."""
    tables, q, padded, num_reqs = case["tables"], case["q"], case["padded"], case["num_reqs"]
    L = case["max_model_len"]
    extra = case["accepted_extra"]
    extra = [0] * num_reqs if extra is None else extra.tolist()
    starts = [a + e + case["start_offset"] for a, e in zip(case["accepted"].tolist(), extra)]
    ids, rows = case["next_token_ids"].tolist(), case["next_token_rows"]
    rows = list(range(num_reqs)) if rows is None else rows.tolist()
    anchors = [ids[r] for r in rows[:num_reqs]] + [0] * (padded - num_reqs)
    positions, seq_lens = [], []
    for row in range(padded):
        if row < num_reqs:
            positions.append([min(starts[row] + j, L - 1) for j in range(q)])
            seq_lens.append(min(starts[row] + q, L))
        else:
            positions.append([0] * q)
            seq_lens.append(0)
    slots = []
    for group in range(tables.num_kv_cache_groups):
        if group not in case["buffers"].group_ids_host:
            slots.append([SENTINEL] * (padded * q))
            continue
        slots.append([_brute_slot(tables, group, row, positions[row][j], case["sharded"][group])
                      if row < num_reqs else -1 for row in range(padded) for j in range(q)])
    return dict(anchors=anchors, ids_col0=anchors, positions=positions, seq_lens=seq_lens,
                slots=slots)


def run_write(case: dict, fn, lowering: PlanLowering | None = None) -> None:
    """Call a write_block_inputs variant (kernel, twin or dispatcher) on `case`."""
    kwargs = {} if lowering is None else {"lowering": lowering}
    fn(case["tables"], case["buffers"], case["num_reqs"], case["padded"], case["q"],
       case["accepted"], case["next_token_ids"], case["max_model_len"], case["start_offset"],
       accepted_extra=case["accepted_extra"], next_token_rows=case["next_token_rows"], **kwargs)


def observed_writes(case: dict) -> dict:
    buffers, q, padded = case["buffers"], case["q"], case["padded"]
    n = padded * q
    return dict(anchors=buffers.anchors[:padded].tolist(),
                ids_col0=buffers.input_ids[:n].view(padded, q)[:, 0].tolist(),
                positions=buffers.positions[:n].view(padded, q).tolist(),
                seq_lens=buffers.seq_lens[:padded].tolist(),
                slots=case["tables"].slot_mappings[:, :n].tolist())


def untouched_tails(case: dict) -> bool:
    """Nothing past the padded rows' tokens was written, and mask columns were left alone."""
    buffers, q, padded = case["buffers"], case["q"], case["padded"]
    n = padded * q
    ids = buffers.input_ids[:n].view(padded, q)[:, 1:]
    return bool((buffers.anchors[padded:] == SENTINEL).all()
                and (buffers.positions[n:] == SENTINEL).all() and (buffers.input_ids[n:] == SENTINEL)
                .all() and (buffers.seq_lens[padded:] == SENTINEL).all()
                and (ids == SENTINEL).all()
                and (case["tables"].slot_mappings[:, n:] == SENTINEL).all())


def random_lowering(case: dict, seed: int) -> PlanLowering:
    """A held plan's lowering for `case`'s rows (plan_lowering.PlanLowering): works of random
    real requests (a plan's index lists no padding request), their kv_len and kv_end positions
    distinct entries of a SENTINEL-filled int32 workspace, and a kv_len_arr."""
    rng = random.Random(1000 + seed)
    device = case["buffers"].seq_lens.device
    num_reqs = case["num_reqs"]
    num_len, num_end = (rng.randint(0, 70), rng.randint(0, 9)) if num_reqs else (0, 0)
    positions = rng.sample(range(160), num_len + num_end)
    reqs = [rng.randrange(num_reqs) for _ in range(num_len + num_end)]
    index = (positions[:num_len] + reqs[:num_len] + positions[num_len:] + reqs[num_len:])
    return PlanLowering(
        ws=torch.full((160,), SENTINEL, dtype=torch.int32, device=device),
        index=torch.tensor(index, dtype=torch.int64, device=device),
        num_len=num_len, num_end=num_end,
        kv_len_arr=torch.full((8,), SENTINEL, dtype=torch.int32, device=device),
        num_reqs=case["num_reqs"])


def expected_lowering(case: dict, lowering: PlanLowering) -> tuple[list[int], list[int]]:
    """Brute force: (workspace, kv_len_arr) after the lowering, every listed position holding
    its request's new seq_len (expected_writes'), the first num_reqs of kv_len_arr too."""
    seq_lens = expected_writes(case)["seq_lens"]
    ws = [SENTINEL] * lowering.ws.shape[0]
    index = lowering.index.tolist()
    n, m = lowering.num_len, lowering.num_end
    for pos, req in zip(index[:n], index[n:2 * n]):
        ws[pos] = seq_lens[req]
    for pos, req in zip(index[2 * n:2 * n + m], index[2 * n + m:]):
        ws[pos] = seq_lens[req]
    arr = [SENTINEL] * lowering.kv_len_arr.shape[0]
    arr[:lowering.num_reqs] = seq_lens[:lowering.num_reqs]
    return ws, arr
