"""The shared draft-metadata builder (DESIGN §6), mirroring upstream's tests, plus per-group causality."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.utils.spec_fakes import brute_local_len, make_speculator
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu.cp_utils import prepare_dcp_local_seq_lens
from vllm.v1.worker.gpu.spec_decode import speculator as speculator_module
from vllm.v1.worker.gpu.spec_decode.speculator import Speculator


def test_cpu_upper_bound_adds_step_and_zeroes_padding():
    spec, (builder,) = make_speculator(Speculator)
    spec._build_draft_attn_metadata(num_reqs=3, num_reqs_padded=4, num_tokens_padded=4,
                                    seq_lens_cpu_upper_bound=np.array([100, 200, 300, 0]), step=2)
    bound = builder.calls[-1].upper_bound
    assert bound.device.type == "cpu" and bound.dtype == torch.int32 and bound.shape == (4,)
    assert bound.tolist() == [102, 202, 302, 0]
    assert builder.calls[-1].common.max_seq_len == 302


def test_zero_real_requests_gives_zeros():
    spec, (builder,) = make_speculator(Speculator)
    spec._build_draft_attn_metadata(num_reqs=0, num_reqs_padded=4, num_tokens_padded=4,
                                    seq_lens_cpu_upper_bound=np.array([100, 200, 300, 400]),
                                    step=3, num_query_per_req=1)
    snap = builder.calls[-1]
    assert snap.upper_bound.tolist() == [0, 0, 0, 0]
    assert snap.upper_bound.dtype == torch.int32
    assert snap.query_start_loc == [0, 0, 0, 0, 0]
    assert snap.seq_lens == [0, 0, 0, 0]


def test_upper_bound_clamped_to_max_model_len():
    spec, (builder,) = make_speculator(Speculator, max_model_len=1024)
    spec._build_draft_attn_metadata(num_reqs=2, num_reqs_padded=2, num_tokens_padded=2,
                                    seq_lens_cpu_upper_bound=torch.tensor([1023, 500]), step=3)
    assert builder.calls[-1].upper_bound.tolist() == [1024, 503]


def test_query_start_loc_rows_are_min_i_num_reqs_times_q():
    spec, (builder,) = make_speculator(Speculator)
    spec._build_draft_attn_metadata(num_reqs=3, num_reqs_padded=5, num_tokens_padded=12,
                                    seq_lens_cpu_upper_bound=np.array([10, 20, 30]), step=4,
                                    num_query_per_req=4)
    snap = builder.calls[-1]
    assert snap.query_start_loc == [0, 4, 8, 12, 12, 12]
    assert snap.common.max_query_len == 4 and snap.common.num_actual_tokens == 12
    assert spec.input_buffers.query_start_loc[:6].tolist() == [0, 4, 8, 12, 12, 12]


def test_build_draft_attn_metadata_recomputes_dcp_local_seq_lens(monkeypatch):
    """The shared draft builder recomputes rank-local lengths from the draft's OWN seq_lens, through
    the patched module-level prepare_dcp_local_seq_lens, into its persistent buffer."""
    spec, (builder,) = make_speculator(Speculator, cp_size=2, cp_rank=1, interleave=4)
    buffers = spec.input_buffers
    calls = []

    def recording_prepare(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave):
        calls.append((out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave))
        prepare_dcp_local_seq_lens(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)

    monkeypatch.setattr(speculator_module, "prepare_dcp_local_seq_lens", recording_prepare)
    buffers.seq_lens[:3] = torch.tensor([5, 9, 16], dtype=torch.int32)
    buffers.dcp_local_seq_lens.fill_(99)  # stale values must not survive
    spec._build_draft_attn_metadata(num_reqs=3, num_reqs_padded=4, num_tokens_padded=4,
                                    seq_lens_cpu_upper_bound=np.array([5, 9, 16]), step=1)
    assert len(calls) == 1
    out, seq_lens, *args = calls[0]
    assert out is buffers.dcp_local_seq_lens
    assert seq_lens is buffers.seq_lens
    assert tuple(args) == (3, 2, 1, 4)
    snap = builder.calls[-1]
    assert snap.dcp_local_data_ptr == buffers.dcp_local_seq_lens.data_ptr()
    assert snap.dcp_local_seq_lens == [1, 4, 8, 0]
    assert snap.common.dcp_local_seq_lens.shape == (4,)


@pytest.mark.parametrize("draft_dcp", [1, 2, None])
def test_build_draft_attn_metadata_recompute_reads_the_speculators_dcp_size(monkeypatch,
                                                                            draft_dcp):
    """The recompute condition reads the speculator's OWN DCP size, not block_tables.cp_size
    (the target's: the runner shares one BlockTables). A replicated drafter
    (draft_decode_context_parallel_size=1) under a DCP-2 target does not recompute rank-local
    lengths and describes its batch with global lengths; a sharded one (2, or unset = the
    target's) does."""
    spec, (builder,) = make_speculator(Speculator, cp_size=2, cp_rank=1, interleave=1,
                                       draft_dcp=draft_dcp)
    assert spec.block_tables.cp_size == 2
    calls = []

    def recording_prepare(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave):
        calls.append((num_reqs, cp_size, cp_rank, cp_interleave))
        prepare_dcp_local_seq_lens(out, seq_lens, num_reqs, cp_size, cp_rank, cp_interleave)

    monkeypatch.setattr(speculator_module, "prepare_dcp_local_seq_lens", recording_prepare)
    spec.input_buffers.seq_lens[:3] = torch.tensor([5, 9, 16], dtype=torch.int32)
    spec._build_draft_attn_metadata(num_reqs=3, num_reqs_padded=4, num_tokens_padded=4,
                                    seq_lens_cpu_upper_bound=np.array([5, 9, 16]), step=1,
                                    seq_lens_np=np.array([5, 9, 16]))
    snap = builder.calls[-1]
    assert snap.seq_lens == [5, 9, 16, 0]  # global lengths either way
    if draft_dcp == 1:
        assert spec.dcp_size == 1 and calls == []
        assert snap.dcp_local_seq_lens is None and snap.common.dcp_local_seq_lens_cpu is None
    else:
        assert spec.dcp_size == 2 and calls == [(3, 2, 1, 1)]
        expected = [brute_local_len(n, 2, 1, 1) for n in (5, 9, 16)]
        assert snap.dcp_local_seq_lens == expected + [0]
        assert snap.common.dcp_local_seq_lens_cpu.tolist() == expected + [0]


def test_replicated_drafter_slots_cover_every_position_on_every_rank():
    """The draft build's slot mapping follows the draft group's own sharding: a replicated
    draft group stores each draft token on every rank, the sharded target group only on its
    owner."""
    by_rank = []
    for rank in (0, 1):
        spec, _ = make_speculator(Speculator, cp_size=2, cp_rank=rank, draft_dcp=1,
                                  group_non_causal=(False, True), draft_groups=(1,))
        spec.input_buffers.positions[:6] = torch.tensor([8, 9, 10, 29, 30, 31])
        spec.input_buffers.seq_lens[:2] = torch.tensor([12, 32], dtype=torch.int32)
        spec._build_draft_attn_metadata(num_reqs=2, num_reqs_padded=2, num_tokens_padded=6,
                                        seq_lens_cpu_upper_bound=np.array([12, 32]), step=0,
                                        num_query_per_req=3, causal=False)
        by_rank.append(spec.block_tables.slot_mappings[:, :6].clone())
    target = torch.stack([r[0] for r in by_rank])
    draft = torch.stack([r[1] for r in by_rank])
    assert ((target >= 0).sum(0) == 1).all()  # the target group: exactly one owner per token
    assert (draft >= 0).all() and torch.equal(draft[0], draft[1])


def test_speculator_refuses_a_draft_dcp_size_the_target_cannot_host():
    with pytest.raises(ValueError, match="draft_decode_context_parallel_size=4 is invalid"):
        make_speculator(Speculator, cp_size=2, draft_dcp=4)


def test_explicit_dcp_local_seq_lens_is_used_as_given(monkeypatch):
    spec, (builder,) = make_speculator(Speculator, cp_size=2, cp_rank=0, interleave=1)
    monkeypatch.setattr(speculator_module, "prepare_dcp_local_seq_lens",
                        lambda *a: pytest.fail("must not recompute when lengths are passed"))
    given = torch.tensor([3, 4], dtype=torch.int32)
    spec._build_draft_attn_metadata(num_reqs=2, num_reqs_padded=2, num_tokens_padded=2,
                                    seq_lens_cpu_upper_bound=np.array([6, 8]), step=1,
                                    dcp_local_seq_lens=given)
    assert builder.calls[-1].dcp_local_data_ptr == given.data_ptr()


def test_cp_size_one_keeps_none(monkeypatch):
    spec, (builder,) = make_speculator(Speculator, cp_size=1)
    monkeypatch.setattr(speculator_module, "prepare_dcp_local_seq_lens",
                        lambda *a: pytest.fail("cp_size 1 needs no local lengths"))
    spec._build_draft_attn_metadata(num_reqs=2, num_reqs_padded=2, num_tokens_padded=2,
                                    seq_lens_cpu_upper_bound=np.array([6, 8]), step=1)
    assert builder.calls[-1].dcp_local_seq_lens is None


@pytest.mark.parametrize("cp_size,cp_rank,interleave", [(2, 0, 1), (4, 3, 1), (2, 1, 4), (3, 2, 2)])
def test_recomputed_values_match_brute_force(cp_size, cp_rank, interleave):
    spec, (builder,) = make_speculator(Speculator, cp_size=cp_size, cp_rank=cp_rank,
                                       interleave=interleave)
    lens = [1, 7, 13, 30]
    spec.input_buffers.seq_lens[:4] = torch.tensor(lens, dtype=torch.int32)
    spec._build_draft_attn_metadata(num_reqs=4, num_reqs_padded=6, num_tokens_padded=6,
                                    seq_lens_cpu_upper_bound=np.array(lens), step=0)
    expected = [brute_local_len(n, cp_size, cp_rank, interleave) for n in lens] + [0, 0]
    assert builder.calls[-1].dcp_local_seq_lens == expected


def test_causal_is_per_group_and_only_draft_groups_are_built():
    spec, (target_builder, draft_builder) = make_speculator(
        Speculator, group_non_causal=(False, True), draft_groups=(1,))
    metadata = spec._build_draft_attn_metadata(
        num_reqs=2, num_reqs_padded=2, num_tokens_padded=8,
        seq_lens_cpu_upper_bound=np.array([6, 8]), step=4, num_query_per_req=4, causal=False)
    assert target_builder.calls == []
    assert draft_builder.calls[-1].causal is False
    assert set(metadata) == {"group1.attn"}


def test_real_builder_aliases_recomputed_buffer():
    from vllm.v1.attention.selector import get_attn_backend
    spec, _ = make_speculator(Speculator, cp_size=2, cp_rank=1, interleave=4,
                              group_non_causal=(False, True), draft_groups=(1,))
    from types import SimpleNamespace
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=2,
                                                          cp_kv_cache_interleave_size=4))
    builder_cls = get_attn_backend("TORCH_MLA").get_builder_cls()
    spec.attn_metadata_builders = [
        builder_cls(g.kv_cache_spec, g.layer_names, cfg, "cpu", dcp_rank=1)
        for g in spec.kv_cache_config.kv_cache_groups]
    spec.input_buffers.seq_lens[:3] = torch.tensor([5, 9, 16], dtype=torch.int32)
    metadata = spec._build_draft_attn_metadata(
        num_reqs=3, num_reqs_padded=3, num_tokens_padded=6,
        seq_lens_cpu_upper_bound=np.array([5, 9, 16]), step=2, num_query_per_req=2, causal=False)
    decode = metadata["group1.attn"].decode
    assert decode.causal is False
    assert decode.seq_lens.data_ptr() == spec.input_buffers.dcp_local_seq_lens.data_ptr()
    assert decode.seq_lens.tolist() == [1, 4, 8]
    assert decode.dcp_tot_seq_lens.tolist() == [5, 9, 16]


# ------------------------------------------------------------------ attn_utils
def _config(flags):
    return KVCacheConfig(num_blocks=8, kv_cache_groups=[
        KVCacheGroupSpec([f"g{g}.a", f"g{g}.b"], MLAAttentionSpec(
            block_size=16, dtype=torch.float32, non_causal_multi_token_decode=flag))
        for g, flag in enumerate(flags)])


def _build(flags, causal, builders):
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    return attn_utils.build_attn_metadata(
        attn_metadata_builders=builders, kv_cache_config=_config(flags), num_reqs=2, num_tokens=4,
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([5, 7]),
        max_query_len=2, max_seq_len=7,
        block_tables=[torch.zeros(2, 4, dtype=torch.int32)] * len(flags),
        slot_mappings=torch.arange(4 * len(flags)).view(len(flags), 4), causal=causal)


def test_build_attn_metadata_causal_map_missing_groups_default_true():
    from tests.utils.spec_fakes import RecordingBuilder
    builders = [RecordingBuilder(), RecordingBuilder(), RecordingBuilder()]
    metadata = _build((False, True, True), {1: False}, builders)
    assert [b.calls[-1].causal for b in builders] == [True, False, True]
    assert metadata["g1.a"] is metadata["g1.b"]
    assert metadata["g2.a"].slot_mapping.tolist() == [8, 9, 10, 11]


def test_build_attn_metadata_bool_applies_to_every_group():
    from tests.utils.spec_fakes import RecordingBuilder
    builders = [RecordingBuilder(), RecordingBuilder()]
    _build((True, True), False, builders)
    assert [b.calls[-1].causal for b in builders] == [False, False]


@pytest.mark.parametrize("causal", [{2: False}, {-1: True}, "yes"])
def test_build_attn_metadata_rejects_bad_causal(causal):
    from tests.utils.spec_fakes import RecordingBuilder
    with pytest.raises(ValueError, match="causal"):
        _build((False, True), causal, [RecordingBuilder(), RecordingBuilder()])


def test_query_starts_and_host_lengths_follow_every_build_in_a_sequence():
    # The uniform query starts are rewritten (and copied to the device) only when
    # (num_reqs, num_reqs_padded, Q) change, and the host lengths live in persistent buffers:
    # a sequence of builds that changes one thing at a time, with an explicit-starts build
    # (EAGLE's first pass) in between, must see exactly the brute-force layout every time.
    spec, (builder,) = make_speculator(Speculator)
    sequence = [(3, 4, 4, None), (3, 4, 4, None), (2, 4, 4, None), (2, 2, 4, None),
                (3, 3, 1, None), (3, 3, 1, [0, 2, 5, 6]), (3, 3, 1, None), (3, 4, 4, None),
                (3, 4, 1, None), (0, 2, 4, None)]
    for num_reqs, padded, q, explicit in sequence:
        lengths = np.arange(num_reqs) * 7 + 11
        qsl_np = None if explicit is None else np.array(explicit)
        tokens = padded * q if explicit is None else explicit[-1]
        spec._build_draft_attn_metadata(
            num_reqs=num_reqs, num_reqs_padded=padded, num_tokens_padded=tokens,
            seq_lens_cpu_upper_bound=lengths, step=q, num_query_per_req=q,
            query_start_loc_np=qsl_np, seq_lens_np=lengths + q)
        want = (explicit if explicit is not None
                else [min(i, num_reqs) * q for i in range(padded + 1)])
        snap = builder.calls[-1]
        assert snap.query_start_loc == want
        assert spec.input_buffers.query_start_loc[: padded + 1].tolist() == want
        assert snap.common.max_query_len == (max(np.diff(want)) if explicit else q)
        seq_cpu = snap.common.seq_lens_cpu
        assert seq_cpu.tolist() == list(lengths + q) + [0] * (padded - num_reqs)
        assert snap.upper_bound.tolist() == list(lengths + q) + [0] * (padded - num_reqs)
