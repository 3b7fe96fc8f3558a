"""MLACommonMetadataBuilder rules (DESIGN §3) and the DSpark+DCP start-up validation."""
import pytest
import torch

from tests.utils.mla_dcp_helpers import mla_spec, parallel_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.common import (MLACommonMetadataBuilder,
                                                    validate_dspark_dcp_backends)
from vllm.v1.attention.backends.mla.flashinfer_mla import FlashInferMLAMetadataBuilder
from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder


def common_md(qsl, seq_lens, causal=True, local=None, max_blocks=4):
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    n = len(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=n,
        num_actual_tokens=qsl[-1], max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens), block_table_tensor=torch.arange(n * max_blocks,
                                                                   dtype=torch.int32).view(n, -1),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), causal=causal,
        dcp_local_seq_lens=None if local is None else torch.tensor(local, dtype=torch.int32))


def builder(cls=TorchMLAMetadataBuilder, non_causal=True, dcp=1, interleave=1, rank=0, bs=16,
            threshold=1):
    b = cls(mla_spec(bs, non_causal), ["l0"], parallel_config(dcp, interleave), "cpu",
            dcp_rank=rank)
    b.reorder_batch_threshold = threshold  # the runner sets 1 + num_speculative_tokens
    return b


def test_non_causal_needs_builder_capability():
    with pytest.raises(ValueError, match="explicitly supported"):
        builder(MLACommonMetadataBuilder).build(0, common_md([0, 4, 8], [20, 30], causal=False))


def test_non_causal_needs_group_flag():
    with pytest.raises(ValueError, match="explicitly supported"):
        builder(non_causal=False).build(0, common_md([0, 4, 8], [20, 30], causal=False))


def test_decode_kinds():
    from vllm.v1.attention.backends.mla.common import MLADecodeKind as K
    b = builder(threshold=3)
    assert b.build(0, common_md([0, 1, 2], [9, 9])).decode.kind == K.CAUSAL_SINGLE
    assert b.build(0, common_md([0, 1, 4], [9, 9])).decode.kind == K.CAUSAL_MULTI
    assert b.build(0, common_md([0, 3, 6], [9, 9], causal=False)).decode.kind == K.NON_CAUSAL_BLOCK


def test_non_causal_with_both_is_accepted():
    md = builder().build(0, common_md([0, 4, 8], [20, 30], causal=False))
    assert md.causal is False and md.decode.causal is False
    assert md.num_decodes == 2 and md.num_decode_tokens == 8 and md.prefill is None
    assert md.decode.row_seq_lens.tolist() == [20] * 4 + [30] * 4


def test_trailing_cuda_graph_padding_is_uniform():
    md = builder().build(0, common_md([0, 8, 16, 16], [20, 30, 0], causal=False))
    assert md.decode.max_query_len == 8 and md.num_decode_tokens == 16


@pytest.mark.parametrize("qsl", [[0, 8, 8, 16], [0, 4, 12], [0, 8, 12]])
def test_non_uniform_block_is_rejected(qsl):
    seq = [40] * (len(qsl) - 1)
    with pytest.raises(ValueError, match="uniform query block"):
        builder().build(0, common_md(qsl, seq, causal=False))


def test_causal_batch_on_marked_group_stays_causal():
    md = builder(non_causal=True, threshold=3).build(0, common_md([0, 3, 6], [10, 12],
                                                                  causal=True))
    assert md.causal is True and md.decode.causal is True
    assert md.decode.row_seq_lens.tolist() == [8, 9, 10, 10, 11, 12]


@pytest.mark.parametrize("dcp", [1, 2])
def test_non_causal_decode_metadata_aliases_live_buffers(dcp):
    cm = common_md([0, 4, 8], [20, 30], causal=False, local=[10, 15] if dcp == 2 else None)
    md = builder(dcp=dcp).build(0, cm)
    live = cm.dcp_local_seq_lens if dcp == 2 else cm.seq_lens
    assert md.decode.seq_lens is live
    assert md.decode.block_table is cm.block_table_tensor
    assert md.decode.seq_lens.data_ptr() == live.data_ptr()
    live[0] = 7  # a later in-place update by the runner is visible through the metadata
    assert int(md.decode.seq_lens[0]) == 7


def _brute_local(seq_lens, n, r, inter):
    return [sum(1 for t in range(L) if (t // inter) % n == r) for L in seq_lens]


def test_dcp_metadata_local_and_global_lengths_and_bound():
    # N=2, I=4: seq_lens [5, 9, 16] on rank 1 -> local [1, 4, 8] (DESIGN §2), handed in by the
    # caller and passed through untouched (aliased, not recomputed).
    local = _brute_local([5, 9, 16], 2, 1, 4)
    assert local == [1, 4, 8]
    cm = common_md([0, 1, 2, 3], [5, 9, 16], local=local)
    md = builder(dcp=2, interleave=4, rank=1).build(0, cm)
    assert md.decode.seq_lens.data_ptr() == cm.dcp_local_seq_lens.data_ptr()
    assert md.decode.seq_lens.tolist() == [1, 4, 8]
    assert md.decode.dcp_tot_seq_lens.tolist() == [5, 9, 16]
    assert md.decode.max_seq_len == 8  # ceil(16 / (2*4)) * 4
    md17 = builder(dcp=2, interleave=4).build(0, common_md([0, 1], [17],
                                                            local=_brute_local([17], 2, 0, 4)))
    assert md17.decode.max_seq_len == 12  # ceil(17/8)*4 >= local(17, r) for every r


def test_dcp_builder_raises_without_local_lengths():
    """Under DCP the rank-local lengths are the caller's job (runner or speculator); a builder
    that silently recomputed them from global lengths would hide stale draft lengths."""
    with pytest.raises(ValueError, match="dcp_local_seq_lens"):
        builder(dcp=2, interleave=4, rank=1).build(0, common_md([0, 1, 2, 3], [5, 9, 16]))
    with pytest.raises(ValueError, match="dcp_local_seq_lens"):
        builder(dcp=4).build(0, common_md([0, 4, 8], [20, 30], causal=False))


def test_decode_rows_first_then_prefill():
    # rows: decode (ctx 9), decode Q=3 (ctx 5), prefill (5 tokens from position 0)
    md = builder(non_causal=False, threshold=3).build(0, common_md([0, 1, 4, 9], [10, 8, 5]))
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 4, 1)
    assert md.prefill.query_start_loc.tolist() == [0, 5]
    assert md.prefill.seq_lens.tolist() == [5]
    assert md.decode.row_seq_lens.tolist() == [10, 6, 7, 8]


def test_padding_rows_after_prefill_are_ignored():
    # trailing zero-length padding row with a stale seq_len (CUDA-graph padding)
    md = builder(non_causal=False).build(0, common_md([0, 1, 6, 6], [10, 5, 33]))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (1, 1, 1)


def test_short_row_after_a_prefill_row_takes_the_prefill_path():
    # [prefill 5 tokens, 1 token with context 9]: the second row cannot join the decode rows
    # (they come first), so it is served by the prefill path, with its cached context.
    md = builder(non_causal=False).build(0, common_md([0, 5, 6], [5, 10]))
    assert (md.num_decodes, md.num_prefills, md.decode) == (0, 2, None)
    assert md.prefill.context_lens_cpu.tolist() == [0, 9]
    assert md.prefill.query_start_loc_cpu.tolist() == [0, 5, 6]


def test_non_causal_under_dcp_needs_dcp_capability():
    class NoDcp(MLACommonMetadataBuilder):
        supports_non_causal_multi_token_decode = True
    with pytest.raises(ValueError, match="decode_context_parallel_size=1"):
        builder(NoDcp, dcp=2).build(0, common_md([0, 2, 4], [9, 9], causal=False, local=[5, 5]))


def test_block_size_must_be_a_multiple_of_interleave():
    with pytest.raises(ValueError, match="multiple of"):
        builder(dcp=2, interleave=3, bs=16)


# ------------------------------------------------------ start-up validation
DRAFT, TARGET = mla_spec(64, True), mla_spec(64, False)


def test_flashinfer_mla_dspark_dcp_supports_target_only():
    """DSpark under DCP with only the causal target group on FLASHINFER_MLA (the draft group on
    another capable builder): the target builder declares varlen multi-token decode under DCP."""
    assert FlashInferMLAMetadataBuilder.supports_dcp_with_varlen
    validate_dspark_dcp_backends("dspark", 2, [(TARGET, FlashInferMLAMetadataBuilder),
                                               (DRAFT, TorchMLAMetadataBuilder)])
    validate_dspark_dcp_backends("dspark", 4, [(False, FlashInferMLAMetadataBuilder)])


def test_flashinfer_mla_dspark_dcp_supports_target_and_draft():
    """Both the causal target group and the non-causal draft group on FLASHINFER_MLA under DCP."""
    assert FlashInferMLAMetadataBuilder.supports_non_causal_multi_token_dcp
    validate_dspark_dcp_backends("dspark", 2, [(TARGET, FlashInferMLAMetadataBuilder),
                                               (DRAFT, FlashInferMLAMetadataBuilder)])
    validate_dspark_dcp_backends("dspark", 8, [(TARGET, TorchMLAMetadataBuilder),
                                               (DRAFT, TorchMLAMetadataBuilder)])


def test_draft_builder_without_non_causal_dcp_is_rejected():
    class DraftlessBuilder(MLACommonMetadataBuilder):
        supports_non_causal_multi_token_decode = True
        supports_dcp_with_varlen = True
    with pytest.raises(ValueError) as err:
        validate_dspark_dcp_backends("dspark", 2, [(TARGET, FlashInferMLAMetadataBuilder),
                                                   (DRAFT, DraftlessBuilder)])
    msg = str(err.value)
    assert "DraftlessBuilder" in msg and "supports_non_causal_multi_token_dcp" in msg
    assert "decode_context_parallel_size=1" in msg and "backend" in msg


def test_target_builder_without_varlen_dcp_is_rejected():
    class NoVarlenBuilder(MLACommonMetadataBuilder):
        supports_non_causal_multi_token_decode = True
        supports_non_causal_multi_token_dcp = True
    with pytest.raises(ValueError) as err:
        validate_dspark_dcp_backends("dspark", 4, [(False, NoVarlenBuilder),
                                                   (True, FlashInferMLAMetadataBuilder)])
    msg = str(err.value)
    assert "NoVarlenBuilder" in msg and "supports_dcp_with_varlen" in msg
    assert "decode_context_parallel_size=1" in msg


def test_validation_only_applies_to_dspark_with_dcp():
    validate_dspark_dcp_backends("dspark", 1, [(DRAFT, MLACommonMetadataBuilder)])
    validate_dspark_dcp_backends("eagle", 2, [(TARGET, MLACommonMetadataBuilder)])


# ------------------------------------------------- replicated (non-DCP drafter) groups
def _replicated_spec(non_causal=True, bs=16):
    import dataclasses
    return dataclasses.replace(mla_spec(bs, non_causal), dcp_sharded=False)


def test_replicated_group_builds_as_dcp_one_under_a_dcp_target():
    """A replicated draft group holds the whole context on every rank: its builder ignores the
    engine's DCP size and rank and describes rows with global lengths (no rank-local lengths
    needed, none used if handed in)."""
    b = TorchMLAMetadataBuilder(_replicated_spec(), ["d0"], parallel_config(2, 1), "cpu",
                                dcp_rank=1)
    assert (b.dcp_world_size, b.dcp_rank) == (1, 0)
    md = b.build(0, common_md([0, 3, 6], [9, 20], causal=False))
    assert md.decode.seq_lens.tolist() == [9, 20] and md.decode.dcp_tot_seq_lens is None
    assert md.decode.dcp_world_size == 1 and md.decode.max_seq_len == 20
    md = b.build(0, common_md([0, 3, 6], [9, 20], causal=False, local=[5, 10]))
    assert md.decode.seq_lens.tolist() == [9, 20]
    # Sharded twin on the same rank: local lengths and the DCP bound.
    sharded = TorchMLAMetadataBuilder(mla_spec(16, True), ["d0"], parallel_config(2, 1), "cpu",
                                      dcp_rank=1)
    md = sharded.build(0, common_md([0, 3, 6], [9, 20], causal=False, local=[4, 10]))
    assert md.decode.seq_lens.tolist() == [4, 10] and md.decode.dcp_tot_seq_lens.tolist() == [9, 20]


def test_replicated_draft_group_needs_no_dcp_capability():
    """DSpark's start-up check applies to DCP-sharded groups only: a replicated draft group is
    served like DCP 1, so a builder without supports_non_causal_multi_token_dcp is fine there."""
    class NoDcp(MLACommonMetadataBuilder):
        supports_non_causal_multi_token_decode = True
    validate_dspark_dcp_backends("dspark", 2, [(TARGET, TorchMLAMetadataBuilder),
                                               (_replicated_spec(bs=64), NoDcp)])
    with pytest.raises(ValueError, match="supports_non_causal_multi_token_dcp"):
        validate_dspark_dcp_backends("dspark", 2, [(TARGET, TorchMLAMetadataBuilder),
                                                   (DRAFT, NoDcp)])
