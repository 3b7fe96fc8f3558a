"""Brute-force DCP oracles: enumerate tokens one by one instead of using the closed forms."""


def owner_rank(t: int, cp_size: int, interleave: int) -> int:
    # Round-robin hand-out of runs of `interleave` consecutive tokens over the ranks.
    return (t // interleave) % cp_size


def brute_local_len(seq_len: int, cp_size: int, rank: int, interleave: int) -> int:
    return sum(1 for t in range(seq_len) if owner_rank(t, cp_size, interleave) == rank)


def brute_slots(positions, block_table_row, block_size, cp_size, rank, interleave,
                max_position=None):
    """Slot of each position on `rank` by counting: the k-th token a rank owns (k = its rank-local
    ordinal) lives at offset k % block_size of physical block block_table_row[k // block_size]."""
    top = (max(positions) + 1) if max_position is None else max_position
    ordinal = {}
    count = 0
    for t in range(top):
        if owner_rank(t, cp_size, interleave) == rank:
            ordinal[t] = count
            count += 1
    slots = []
    for p in positions:
        if p not in ordinal:
            slots.append(-1)
        else:
            k = ordinal[p]
            slots.append(block_table_row[k // block_size] * block_size + k % block_size)
    return slots
