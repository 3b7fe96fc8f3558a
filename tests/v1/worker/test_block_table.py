import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.input_batch import InputBuffers

from tests.utils.dcp_oracle import brute_slots


def make_tables(block_sizes=(4,), cp_size=1, cp_rank=0, cp_interleave=1, device="cpu"):
    return BlockTables(list(block_sizes), max_num_reqs=6, max_num_blocks_per_req=8,
                       max_num_batched_tokens=64, device=device, cp_size=cp_size,
                       cp_rank=cp_rank, cp_interleave=cp_interleave)


def test_append_overwrite_and_gather_in_batch_order():
    bt = make_tables(block_sizes=(4, 4))
    bt.append_block_ids(3, ([10, 11], [10, 11]), overwrite=False)
    bt.append_block_ids(3, ([12], [12]), overwrite=False)
    bt.append_block_ids(1, ([5, 6, 7], [5, 6, 7]), overwrite=False)
    bt.append_block_ids(1, ([8], [8]), overwrite=True)  # preempted and re-admitted
    ptrs = [t.data_ptr() for t in bt.input_block_tables]
    gathered = bt.gather_block_tables(torch.tensor([3, 1], dtype=torch.int32))
    assert len(gathered) == 2 == bt.num_kv_cache_groups
    for g, table in enumerate(gathered):
        assert table.shape == (2, 8)
        assert table.data_ptr() == ptrs[g]  # a view of the persistent input table
        assert table[0, :3].tolist() == [10, 11, 12]
        assert table[1, :1].tolist() == [8]
    assert bt.num_blocks[0, 3] == 3 and bt.num_blocks[0, 1] == 1
    bt.remove_request(3)
    assert bt.num_blocks[:, 3].tolist() == [0, 0]


def test_append_errors_name_the_problem():
    bt = make_tables()
    with pytest.raises(ValueError, match="max_num_blocks_per_req=8"):
        bt.append_block_ids(0, (list(range(9)),), overwrite=False)
    with pytest.raises(ValueError, match="expected 1"):
        bt.append_block_ids(0, ([1], [2]), overwrite=False)
    with pytest.raises(ValueError, match="req_index=6"):
        bt.append_block_ids(6, ([1],), overwrite=False)
    with pytest.raises(ValueError, match="multiple of cp_interleave=4"):
        make_tables(block_sizes=(6,), cp_size=2, cp_interleave=4)


def test_design_slot_example_through_block_tables():
    # block 16, N=2, I=1, p=37 -> rank 1 writes bt[1]*16+2, rank 0 writes -1.
    for rank, expected in ((0, -1), (1, 3 * 16 + 2)):
        bt = make_tables(block_sizes=(16,), cp_size=2, cp_rank=rank)
        bt.append_block_ids(0, ([7, 3, 9],), overwrite=False)
        bt.gather_block_tables(torch.tensor([0]))
        out = bt.compute_slot_mappings(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([37]))
        assert out.tolist() == [[expected]]


@settings(max_examples=40, deadline=None)
@given(cp_size=st.integers(1, 4), interleave=st.sampled_from([1, 2, 4]), data=st.data())
def test_slot_mappings_match_brute_force(cp_size, interleave, data):
    block_size = interleave * data.draw(st.integers(1, 2))
    num_groups = data.draw(st.integers(1, 2))
    per_rank = [make_tables([block_size] * num_groups, cp_size, r, interleave)
                for r in range(cp_size)]
    virtual = block_size * cp_size
    num_reqs = data.draw(st.integers(1, 4))
    slots_of_req = data.draw(st.permutations(list(range(6))))[:num_reqs]
    # Block ids differ per group to catch group mix-ups; all ranks share them (DESIGN §2).
    ids = {g: {s: data.draw(st.lists(st.integers(0, 50), min_size=8, max_size=8, unique=True))
               for s in slots_of_req} for g in range(num_groups)}
    lengths = [data.draw(st.integers(1, 8 * virtual)) for _ in range(num_reqs)]
    query_lens = [data.draw(st.integers(0, min(L, 6))) for L in lengths]
    positions, qsl = [], [0]
    for L, q in zip(lengths, query_lens):
        positions += list(range(L - q, L))
        qsl.append(qsl[-1] + q)
    num_pad = data.draw(st.integers(0, 3))
    positions_t = torch.tensor(positions + [0] * num_pad)
    stored = {}
    for rank, bt in enumerate(per_rank):
        for s in slots_of_req:
            bt.append_block_ids(s, tuple(ids[g][s] for g in range(num_groups)), overwrite=False)
        bt.gather_block_tables(torch.tensor(slots_of_req))
        out = bt.compute_slot_mappings(torch.tensor(qsl, dtype=torch.int32), positions_t)
        assert out.shape == (num_groups, len(positions) + num_pad)
        if out.numel():
            assert out.data_ptr() == bt.slot_mappings.data_ptr()
        for g in range(num_groups):
            expected = []
            for i, s in enumerate(slots_of_req):
                expected += brute_slots(positions[qsl[i]:qsl[i + 1]], ids[g][s], block_size,
                                        cp_size, rank, interleave, max_position=lengths[i])
            assert out[g].tolist() == expected + [-1] * num_pad
        for t in range(len(positions)):
            if out[0, t] != -1:
                assert t not in stored
                stored[t] = rank
    assert sorted(stored) == list(range(len(positions))), "each token stored on exactly one rank"


@settings(max_examples=30, deadline=None)
@given(cp_size=st.integers(2, 4), interleave=st.sampled_from([1, 2]), data=st.data())
def test_replicated_group_slots_cover_the_full_context_on_every_rank(cp_size, interleave, data):
    """Group 0 is DCP-sharded (the target), group 1 replicated (a non-DCP drafter): group 1
    stores EVERY token on EVERY rank, at the same slot everywhere, in the cp_size pages its block
    id owns (b*cp_size .. b*cp_size + cp_size - 1), never colliding with another token; group 0
    keeps the sharded layout."""
    block_size = interleave * data.draw(st.integers(1, 2))
    virtual = block_size * cp_size
    num_reqs = data.draw(st.integers(1, 4))
    slots_of_req = data.draw(st.permutations(list(range(6))))[:num_reqs]
    # Disjoint block ids per request, as the pool hands them out.
    pool = data.draw(st.permutations(list(range(40))))
    ids = {s: pool[8 * i: 8 * i + 8] for i, s in enumerate(slots_of_req)}
    lengths = [data.draw(st.integers(1, 8 * virtual)) for _ in range(num_reqs)]
    positions, qsl, owner = [], [0], []
    for i, L in enumerate(lengths):
        positions += list(range(L))  # the whole context of every request
        owner += [slots_of_req[i]] * L
        qsl.append(qsl[-1] + L)
    per_rank = []
    for rank in range(cp_size):
        bt = BlockTables([block_size, block_size], max_num_reqs=6, max_num_blocks_per_req=8,
                         max_num_batched_tokens=512, device="cpu", cp_size=cp_size, cp_rank=rank,
                         cp_interleave=interleave, dcp_sharded=[True, False])
        for s in slots_of_req:
            bt.append_block_ids(s, (ids[s], ids[s]), overwrite=False)
        bt.gather_block_tables(torch.tensor(slots_of_req))
        out = bt.compute_slot_mappings(torch.tensor(qsl, dtype=torch.int32),
                                       torch.tensor(positions)).clone()
        expected = []
        for i, s in enumerate(slots_of_req):
            expected += brute_slots(positions[qsl[i]:qsl[i + 1]], ids[s], block_size, cp_size,
                                    rank, interleave, max_position=lengths[i])
        assert out[0].tolist() == expected  # the sharded group is unchanged
        per_rank.append(out[1].tolist())
    replicated = per_rank[0]
    assert all(r == replicated for r in per_rank), "replicated slots differ between ranks"
    assert -1 not in replicated, "a replicated group stores every token on every rank"
    assert len(set(replicated)) == len(replicated), "two tokens share a slot"
    for slot, p, s in zip(replicated, positions, owner):
        block_id = ids[s][p // virtual]
        assert block_id * cp_size <= slot // block_size < (block_id + 1) * cp_size
        assert slot < 40 * cp_size * block_size  # inside the group's pool of pages


def test_replicated_group_capacity_and_errors():
    bt = BlockTables([4, 4], max_num_reqs=2, max_num_blocks_per_req=3, max_num_batched_tokens=16,
                     device="cpu", cp_size=2, dcp_sharded=[True, False])
    assert bt.group_max_blocks == (3, 6) and bt.pages_per_block_id == (1, 2)
    assert bt.group_cp_sizes == (2, 1) and bt.cp_size == 2  # cp_size stays the engine's
    bt.append_block_ids(0, ([7, 3], [7, 3]), overwrite=False)
    assert bt.host_block_tables[1, 0, :4].tolist() == [14, 15, 6, 7]
    assert bt.host_block_tables[0, 0, :2].tolist() == [7, 3]
    with pytest.raises(ValueError, match="max_num_blocks_per_req=3"):
        bt.append_block_ids(0, ([1, 2], [1, 2]), overwrite=False)
    with pytest.raises(ValueError, match="one bool per KV cache group"):
        BlockTables([4, 4], 2, 3, 16, "cpu", cp_size=2, dcp_sharded=[False])


def test_slot_mapping_rejects_position_beyond_table():
    bt = make_tables(block_sizes=(4,), cp_size=2)
    bt.append_block_ids(0, ([1],), overwrite=False)
    bt.gather_block_tables(torch.tensor([0]))
    with pytest.raises(ValueError, match="outside the block table"):
        bt.compute_slot_mappings(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([64]))


def test_input_buffers_are_preallocated():
    buf = InputBuffers(max_num_reqs=4, max_num_tokens=32, device="cpu")
    assert buf.input_ids.shape == (32,) and buf.input_ids.dtype == torch.int64
    assert buf.positions.shape == (32,) and buf.positions.dtype == torch.int64
    assert buf.query_start_loc.shape == (5,) and buf.query_start_loc.dtype == torch.int32
    assert buf.query_start_loc_np.shape == (5,)
    buf.query_start_loc_np[2] = 7
    assert buf.query_start_loc_cpu[2] == 7  # the numpy twin and the CPU tensor share memory
    assert buf.seq_lens.shape == (4,) and buf.seq_lens.dtype == torch.int32
    assert buf.dcp_local_seq_lens.shape == (4,) and buf.dcp_local_seq_lens.dtype == torch.int32
    with pytest.raises(ValueError, match="max_num_reqs=0"):
        InputBuffers(0, 4, "cpu")


@pytest.mark.gpu
def test_triton_slot_mappings_equal_torch_on_cuda():
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        cp_size = [1, 2, 4, 8][trial % 4]
        interleave = [1, 2, 4, 16][(trial // 4) % 4]
        block_size = [16, 32, 64][trial % 3]
        if block_size % interleave:
            continue
        rank = int(torch.randint(0, cp_size, (1,), generator=gen))
        tables = {}
        # Later trials pair a sharded group with a replicated one (non-DCP drafter).
        sharded = [True, True] if trial < 20 else [trial % 2 == 0, trial % 2 == 1]
        for device in ("cpu", "cuda"):
            tables[device] = BlockTables([block_size, block_size], 32, 16, 2048, device, cp_size,
                                         rank, interleave, dcp_sharded=sharded)
        num_reqs = int(torch.randint(1, 17, (1,), generator=gen))
        qsl, positions = [0], []
        for slot in range(32):
            ids = torch.randperm(1000, generator=gen)[:16].tolist()
            for bt in tables.values():
                bt.append_block_ids(slot, (ids, ids[::-1]), overwrite=True)
        for _ in range(num_reqs):
            L = int(torch.randint(1, 16 * block_size * cp_size + 1, (1,), generator=gen))
            q = int(torch.randint(0, min(L, 100) + 1, (1,), generator=gen))
            positions += list(range(L - q, L))
            qsl.append(qsl[-1] + q)
        positions += [0] * 5  # graph padding tail
        idx = torch.randperm(32, generator=gen)[:num_reqs]
        results = {}
        for device, bt in tables.items():
            bt.gather_block_tables(idx.to(device))
            results[device] = bt.compute_slot_mappings(
                torch.tensor(qsl, dtype=torch.int32, device=device),
                torch.tensor(positions, device=device)).cpu()
        assert torch.equal(results["cpu"], results["cuda"]), (cp_size, interleave, block_size)


@pytest.mark.gpu
def test_slot_mappings_are_cuda_graph_capturable():
    bt = BlockTables([16], 4, 8, 64, "cuda", cp_size=2, cp_rank=1, cp_interleave=1)
    bt.append_block_ids(2, ([7, 3, 9],), overwrite=False)
    idx = torch.tensor([2], dtype=torch.int64, device="cuda")
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    positions = torch.tensor([37, 0, 0, 0], device="cuda")
    bt.gather_block_tables(idx)
    bt.compute_slot_mappings(qsl, positions)  # warm-up compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bt.gather_block_tables(idx)
        out = bt.compute_slot_mappings(qsl, positions)
    positions[0] = 38  # owned by rank 0 -> PAD here
    graph.replay()
    torch.cuda.synchronize()
    assert out.cpu().tolist() == [[-1, -1, -1, -1]]
    positions[0] = 37  # DESIGN §2: rank 1 stores p=37 at bt[1]*16+2
    graph.replay()
    torch.cuda.synchronize()
    assert out.cpu().tolist() == [[3 * 16 + 2, -1, -1, -1]]


def test_device_slot_geometry_aliases_the_persistent_buffers():
    """What a fused kernel reads to write slots in-line: the persistent tensors themselves (a
    later gather is seen without asking again), with each group's sharding."""
    bt = BlockTables([16, 32], 4, 8, 64, "cpu", cp_size=2, cp_rank=1, cp_interleave=4,
                     dcp_sharded=[True, False])
    geometry = bt.device_slot_geometry()
    assert geometry is bt.device_slot_geometry()
    assert geometry.slot_mappings.data_ptr() == bt.slot_mappings.data_ptr()
    assert geometry.input_block_tables[1].data_ptr() == bt.input_block_tables[1].data_ptr()
    assert geometry.block_sizes.tolist() == [16, 32]
    assert geometry.group_cp_sizes.tolist() == [2, 1]  # the replicated group is one rank
    assert geometry.group_max_blocks.tolist() == [8, 16]  # and holds cp_size pages per id
    assert (geometry.cp_rank, geometry.cp_interleave) == (1, 4)
    bt.append_block_ids(2, ([7], [7]), overwrite=True)
    bt.gather_block_tables(torch.tensor([2]))
    assert geometry.input_block_tables[0, 0, 0].item() == 7
    assert geometry.input_block_tables[1, 0, :2].tolist() == [14, 15]
