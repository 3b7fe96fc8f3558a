import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm.v1.worker.gpu.cp_utils import (cp_local_slot, get_dcp_local_seq_lens,
                                          prepare_dcp_local_seq_lens)

from tests.utils.dcp_oracle import brute_local_len, brute_slots

INTERLEAVES = st.sampled_from([1, 2, 4, 16])


@settings(max_examples=60, deadline=None)
@given(seq_len=st.integers(0, 300), cp_size=st.integers(1, 8), interleave=INTERLEAVES)
def test_local_lens_match_brute_force_on_every_rank(seq_len, cp_size, interleave):
    per_rank = get_dcp_local_seq_lens(torch.tensor([seq_len]), cp_size, None, interleave)[0]
    expected = [brute_local_len(seq_len, cp_size, r, interleave) for r in range(cp_size)]
    assert per_rank.tolist() == expected
    assert sum(expected) == seq_len
    for r in range(cp_size):
        one = get_dcp_local_seq_lens(torch.tensor([seq_len]), cp_size, r, interleave)
        assert one.tolist() == [expected[r]]


@pytest.mark.parametrize("seq_len,cp_size,interleave,expected", [
    (9, 2, 4, [5, 4]),          # DESIGN §2
    (10, 4, 1, [3, 3, 2, 2]),   # DESIGN §2
    (11, 2, 4, [7, 4]),         # DESIGN §6: EAGLE step 1 after rollback, rank 0 sees 7 (not 8)
    (12, 2, 4, [8, 4]),         # DESIGN §6: target-local r0 = 8
    (14, 2, 4, [8, 6]),         # DESIGN §6: DSpark Q=4 block, r1 = 6
])
def test_design_worked_examples(seq_len, cp_size, interleave, expected):
    assert get_dcp_local_seq_lens(torch.tensor([seq_len]), cp_size, None, interleave)[0].tolist() \
        == expected


def test_batch_example_rank1():
    out = get_dcp_local_seq_lens(torch.tensor([5, 9, 16], dtype=torch.int32), 2, 1, 4)
    assert out.tolist() == [1, 4, 8]
    assert out.dtype == torch.int32


def test_causal_offset_is_not_local():
    # DESIGN §2: N=4, I=1, G=10, r=0: row Q-2 sees local(9)=3, not local(10)-1=2.
    assert get_dcp_local_seq_lens(torch.tensor([9, 10]), 4, 0, 1).tolist() == [3, 3]


def test_prepare_writes_through_buffer_and_zeros_padding():
    out = torch.full((8,), 77, dtype=torch.int32)
    ptr = out.data_ptr()
    seq_lens = torch.tensor([5, 9, 16, 1000, 1000, 1000, 1000, 1000], dtype=torch.int32)
    prepare_dcp_local_seq_lens(out, seq_lens, 3, 2, 1, 4)
    assert out.data_ptr() == ptr
    assert out.tolist() == [1, 4, 8, 0, 0, 0, 0, 0]
    prepare_dcp_local_seq_lens(out, seq_lens, 0, 2, 1, 4)
    assert out.tolist() == [0] * 8


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(0, 200), min_size=1, max_size=12), cp_size=st.integers(1, 8),
       interleave=INTERLEAVES, data=st.data())
def test_prepare_matches_brute_force(lens, cp_size, interleave, data):
    rank = data.draw(st.integers(0, cp_size - 1))
    num_reqs = data.draw(st.integers(0, len(lens)))
    out = torch.full((len(lens) + 3,), -5, dtype=torch.int32)
    prepare_dcp_local_seq_lens(out, torch.tensor(lens, dtype=torch.int32), num_reqs, cp_size, rank,
                               interleave)
    expected = [brute_local_len(L, cp_size, rank, interleave) for L in lens[:num_reqs]]
    assert out.tolist() == expected + [0] * (len(out) - num_reqs)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_reqs=9), "num_reqs=9"),
    (dict(cp_rank=2), "cp_rank=2"),
    (dict(cp_size=0), "cp_size=0"),
    (dict(cp_interleave=0), "cp_interleave=0"),
])
def test_prepare_rejects_bad_arguments(kwargs, needle):
    args = dict(num_reqs=2, cp_size=2, cp_rank=0, cp_interleave=1)
    args.update(kwargs)
    out = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=needle):
        prepare_dcp_local_seq_lens(out, torch.zeros(8, dtype=torch.int32), **args)


def test_slot_design_example():
    # DESIGN §2: block 16, N=2, I=1, p=37 -> rank 1 writes bt[1]*16+2, rank 0 writes -1.
    bt = torch.tensor([7, 3, 9])
    assert cp_local_slot(torch.tensor([37]), bt, 16, 2, 1, 1).tolist() == [3 * 16 + 2]
    assert cp_local_slot(torch.tensor([37]), bt, 16, 2, 0, 1).tolist() == [-1]


@settings(max_examples=40, deadline=None)
@given(cp_size=st.integers(1, 8), interleave=INTERLEAVES,
       blocks_per_interleave=st.integers(1, 3), data=st.data())
def test_slots_store_every_position_once(cp_size, interleave, blocks_per_interleave, data):
    block_size = interleave * blocks_per_interleave
    num_blocks = data.draw(st.integers(1, 5))
    block_ids = data.draw(st.permutations(list(range(20)))).copy()[:num_blocks]
    length = num_blocks * block_size * cp_size
    positions = torch.arange(length)
    stored_by = {}
    for rank in range(cp_size):
        slots = cp_local_slot(positions, torch.tensor(block_ids), block_size, cp_size, rank,
                              interleave).tolist()
        assert slots == brute_slots(list(range(length)), block_ids, block_size, cp_size, rank,
                                    interleave)
        real = [s for s in slots if s != -1]
        assert len(real) == len(set(real)), "two positions share a slot on one rank"
        for p, s in enumerate(slots):
            if s != -1:
                assert p not in stored_by, f"position {p} stored on two ranks"
                stored_by[p] = rank
    assert sorted(stored_by) == list(range(length)), "some position is stored on no rank"


@settings(max_examples=20, deadline=None)
@given(block_size=st.integers(1, 32), data=st.data())
def test_slots_reduce_to_plain_paging_without_dcp(block_size, data):
    block_ids = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=6))
    positions = list(range(len(block_ids) * block_size))
    slots = cp_local_slot(torch.tensor(positions), torch.tensor(block_ids), block_size, 1, 0, 1)
    assert slots.tolist() == [block_ids[p // block_size] * block_size + p % block_size
                              for p in positions]


def test_slot_rejects_position_outside_table_and_bad_block_size():
    with pytest.raises(ValueError, match="virtual blocks"):
        cp_local_slot(torch.tensor([64]), torch.tensor([0, 1]), 16, 2, 0, 1)
    with pytest.raises(ValueError, match="block_size=6"):
        cp_local_slot(torch.tensor([0]), torch.tensor([0]), 6, 2, 0, 4)


@pytest.mark.gpu
def test_triton_prepare_equals_torch_on_cuda():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 600, (1,), generator=gen))
        seq_lens = torch.randint(0, 100_000, (n,), generator=gen, dtype=torch.int32)
        cp_size = int(torch.randint(1, 9, (1,), generator=gen))
        rank = int(torch.randint(0, cp_size, (1,), generator=gen))
        interleave = [1, 2, 4, 16][trial % 4]
        num_reqs = int(torch.randint(0, n + 1, (1,), generator=gen))
        cpu_out = torch.full((n,), 3, dtype=torch.int32)
        prepare_dcp_local_seq_lens(cpu_out, seq_lens, num_reqs, cp_size, rank, interleave)
        gpu_out = torch.full((n,), 3, dtype=torch.int32, device="cuda")
        ptr = gpu_out.data_ptr()
        prepare_dcp_local_seq_lens(gpu_out, seq_lens.cuda(), num_reqs, cp_size, rank, interleave)
        assert gpu_out.data_ptr() == ptr
        assert torch.equal(gpu_out.cpu(), cpu_out)


@pytest.mark.gpu
def test_prepare_is_cuda_graph_capturable():
    out = torch.full((16,), 7, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(16, dtype=torch.int32, device="cuda")
    seq_lens[:5] = torch.tensor([5, 9, 16, 100, 33], dtype=torch.int32, device="cuda")
    prepare_dcp_local_seq_lens(out, seq_lens, 5, 2, 1, 4)  # warm-up compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepare_dcp_local_seq_lens(out, seq_lens, 5, 2, 1, 4)
    seq_lens[:5] = torch.tensor([1, 2, 3, 4, 200], dtype=torch.int32, device="cuda")
    out.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    # local(L, r=1) with N=2, I=4, by brute force
    expected = [brute_local_len(L, 2, 1, 4) for L in [1, 2, 3, 4, 200]] + [0] * 11
    assert out.cpu().tolist() == expected
