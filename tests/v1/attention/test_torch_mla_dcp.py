"""TORCH_MLA exactness: DCP=N (sharded cache, LSE merge) equals DCP=1 equals dense float64."""
import pytest
import torch

from tests.utils.mla_dcp_helpers import build_rank, make_case, reference_decode
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAImpl, TorchMLAMetadataBuilder
from vllm.v1.attention.ops.dcp_combine import correct_attn_out, merge_attn_states

# (seq_lens, query_lens, causal): single token, verification blocks, non-causal blocks.
# Short sequences (2, 3, 5) leave ranks with empty rows at N=4/8.
KINDS = {
    "causal_single": ([2, 9, 37, 3], [1, 1, 1, 1], True),
    "causal_multi": ([5, 10, 41, 3], [4, 3, 4, 2], True),
    "causal_varlen": ([12, 30, 5], [1, 5, 3], True),
    "non_causal_block": ([5, 19, 40, 3], [3, 3, 3, 3], False),
}
GEOMETRIES = [(2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (8, 1), (2, 4), (4, 4)]


def run_rank(case, n, rank, interleave, block_size=8):
    md, cache, _, _ = build_rank(case, TorchMLAMetadataBuilder, n, rank, interleave, block_size)
    impl = TorchMLAImpl(num_heads=case.q.shape[1], scale=case.scale)
    return impl.forward_decode(case.q, cache, md.decode)


@pytest.mark.parametrize("kind", list(KINDS))
def test_dcp1_matches_dense_reference(kind):
    seq_lens, qlens, causal = KINDS[kind]
    case = make_case(seq_lens, qlens, causal=causal, seed=1)
    out, lse = run_rank(case, 1, 0, 1)
    ref_out, ref_lse = reference_decode(case)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,interleave", GEOMETRIES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_dcp_n_equals_dcp_1(kind, n, interleave):
    seq_lens, qlens, causal = KINDS[kind]
    case = make_case(seq_lens, qlens, causal=causal, seed=n * 10 + interleave)
    base_out, base_lse = run_rank(case, 1, 0, 1)
    parts = [run_rank(case, n, r, interleave) for r in range(n)]
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1] for p in parts])
    merged_out, merged_lse = merge_attn_states(outs, lses)
    torch.testing.assert_close(merged_out, base_out, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(merged_lse, base_lse, rtol=1e-11, atol=1e-11)
    # the distributed form: each rank rescales its own partial, then the ranks are summed
    summed = sum(correct_attn_out(parts[r][0], lses, r)[0] for r in range(n))
    torch.testing.assert_close(summed, base_out, rtol=1e-11, atol=1e-11)


def test_empty_local_rows_give_zero_and_minus_inf():
    # G=2 and G=3 at N=8: ranks >= 3 own no token of these requests.
    case = make_case([2, 3], [1, 1], causal=True, seed=3)
    out, lse = run_rank(case, 8, 5, 1)
    assert torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    out0, lse0 = run_rank(case, 8, 0, 1)
    assert torch.isfinite(lse0).all() and torch.isfinite(out0).all()


def test_causal_rows_use_global_bounds_not_local_offsets():
    # DESIGN §2: N=4, I=1, G=10, rank 0: row 0 of a Q=2 block sees local(9)=3, not local(10)-1=2.
    case = make_case([10], [2], causal=True, seed=4)
    md, _, _, _ = build_rank(case, TorchMLAMetadataBuilder, 4, 0, 1, 8)
    assert md.decode.row_seq_lens.tolist() == [3, 3]
    md1, _, _, _ = build_rank(case, TorchMLAMetadataBuilder, 4, 1, 1, 8)
    assert md1.decode.row_seq_lens.tolist() == [2, 3]


def test_padding_rows_in_a_non_causal_block_batch():
    case = make_case([6, 13, 0], [4, 4, 0], causal=False, seed=5)
    base_out, _ = run_rank(case, 1, 0, 1)
    parts = [run_rank(case, 2, r, 2) for r in range(2)]
    merged, _ = merge_attn_states(torch.stack([p[0] for p in parts]),
                                  torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(merged, base_out, rtol=1e-11, atol=1e-11)
    ref, _ = reference_decode(case)
    torch.testing.assert_close(base_out, ref, rtol=1e-12, atol=1e-12)
