"""FLASHINFER_MLA call geometry with the kernels replaced by recording fakes (CPU)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.utils import fake_flashinfer
from tests.utils.mla_dcp_helpers import (brute_local_count, build_rank, make_case, mla_spec,
                                       parallel_config, reference_decode)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.flashinfer_mla import (FlashInferMLAImpl,
                                                           FlashInferMLAMetadataBuilder,
                                                           _segments_of_block)
from vllm.v1.attention.ops.dcp_combine import merge_attn_states

SMALL_WS = dict(workspace_bytes=1024)


# ------------------------------------------------------------------ Blackwell
def blackwell_setup(causal):
    """Upstream's example: DCP8 rank 3, 2 requests, Q=3, local [4,5], global [31,35], 24 heads."""
    qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    table = torch.tensor([[10, 11], [20, 21]], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([31, 35], dtype=torch.int32), num_reqs=2, num_actual_tokens=6,
        max_query_len=3, max_seq_len=35, block_table_tensor=table,
        slot_mapping=torch.zeros(6, dtype=torch.int64), causal=causal,
        dcp_local_seq_lens=torch.tensor([4, 5], dtype=torch.int32))
    builder = FlashInferMLAMetadataBuilder(mla_spec(64, non_causal=not causal, dtype=torch.bfloat16),
                                           ["l0"], parallel_config(8, 1), "cpu", dcp_rank=3,
                                           kernel_family="blackwell", **SMALL_WS)
    builder.reorder_batch_threshold = 3  # Q=3 rows are decode (verification) rows
    md = builder.build(0, cm)
    impl = FlashInferMLAImpl(num_heads=24, scale=0.1)
    q = torch.randn(6, 24, 576, dtype=torch.bfloat16)
    cache = torch.zeros(32, 64, 576, dtype=torch.bfloat16)
    out, lse = impl.forward_decode(q, cache, md.decode)
    assert out.shape == (6, 24, 512) and lse.shape == (6, 24) and lse.dtype == torch.float32
    return q, cache


def common_blackwell_checks(call, cache):
    assert call["backend"] == "cute-dsl"
    assert call["enable_dcp"] is True and call["cp_world"] == 8 and call["cp_rank"] == 3
    assert call["return_lse"] is True and call["return_lse_base"] == "basee"
    assert call["kv_cache"].shape == (32, 1, 64, 576)
    assert call["kv_cache"].data_ptr() == cache.data_ptr()
    assert call["kv_lora_rank"] == 512 and call["qk_rope_head_dim"] == 64
    assert call["bmm1_scale"] == pytest.approx(0.1) and call["bmm2_scale"] == 1.0
    assert call["max_seq_len"] == 5  # ceil(35 / 8)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_flashinfer_mla_forward_uses_native_dcp_api(monkeypatch, causal):
    """Blackwell: one trtllm call with the kernel's native DCP arguments. Causal blocks keep their
    [B, Q] shape with [B] global bounds; non-causal blocks become single-token rows whose block
    table, rank-local lengths AND global bounds are all repeated per row (DESIGN §5)."""
    fake = fake_flashinfer.install(monkeypatch)
    q, cache = blackwell_setup(causal=causal)
    (call,) = fake.decode.trtllm_batch_decode_with_kv_cache_mla.calls
    common_blackwell_checks(call, cache)
    assert call["causal_seqlens_kv_global"].dtype == torch.int32
    if causal:
        assert call["query"].shape == (2, 3, 24, 576)
        assert call["block_tables"].tolist() == [[10, 11], [20, 21]]
        assert call["seq_lens"].tolist() == [4, 5]
        assert call["causal_seqlens_kv_global"].tolist() == [31, 35]
    else:
        assert call["query"].shape == (6, 1, 24, 576)
        assert torch.equal(call["query"].reshape(6, 24, 576), q)
        assert call["block_tables"].tolist() == [[10, 11]] * 3 + [[20, 21]] * 3
        assert call["seq_lens"].tolist() == [4, 4, 4, 5, 5, 5]
        assert call["causal_seqlens_kv_global"].tolist() == [31, 31, 31, 35, 35, 35]


@pytest.mark.parametrize("dcp,num_heads,expected", [
    (1, 16, "auto"), (1, 24, "cute-dsl"), (1, 96, "cute-dsl"), (1, 128, "auto"),
    (1, 32, "auto"), (1, 64, "auto"), (2, 16, "cute-dsl"), (8, 128, "cute-dsl")])
def test_blackwell_backend_follows_runtime_head_count(monkeypatch, dcp, num_heads, expected):
    """The recorded trtllm call picks cute-dsl when trtllm-gen cannot tile the gathered head
    count (or under DCP), auto otherwise."""
    fake = fake_flashinfer.install(monkeypatch)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([31, 35], dtype=torch.int32), num_reqs=2, num_actual_tokens=2,
        max_query_len=1, max_seq_len=35,
        block_table_tensor=torch.tensor([[10, 11], [20, 21]], dtype=torch.int32),
        slot_mapping=torch.zeros(2, dtype=torch.int64), causal=True,
        dcp_local_seq_lens=(torch.tensor([31, 35], dtype=torch.int32) // dcp if dcp > 1
                            else None))
    builder = FlashInferMLAMetadataBuilder(mla_spec(64, dtype=torch.bfloat16), ["l0"],
                                           parallel_config(dcp, 1), "cpu", dcp_rank=0,
                                           kernel_family="blackwell", **SMALL_WS)
    md = builder.build(0, cm)
    impl = FlashInferMLAImpl(num_heads=num_heads, scale=0.1)
    impl.forward_decode(torch.randn(2, num_heads, 576, dtype=torch.bfloat16),
                        torch.zeros(32, 64, 576, dtype=torch.bfloat16), md.decode)
    (call,) = fake.decode.trtllm_batch_decode_with_kv_cache_mla.calls
    assert call["backend"] == expected


def test_blackwell_rejects_interleave_and_odd_block_sizes():
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=1"):
        FlashInferMLAMetadataBuilder(mla_spec(64), ["l0"], parallel_config(2, 2), "cpu",
                                     dcp_rank=0, kernel_family="blackwell")
    with pytest.raises(ValueError, match="block_size"):
        FlashInferMLAMetadataBuilder(mla_spec(16), ["l0"], parallel_config(2, 1), "cpu",
                                     dcp_rank=0, kernel_family="blackwell")


# --------------------------------------------------------------------- Hopper
def hopper_rank(case, n, rank, interleave, block_size=4, **kw):
    md, cache, cm, builder = build_rank(case, FlashInferMLAMetadataBuilder, n, rank, interleave,
                                        block_size, builder_kwargs=dict(kernel_family="hopper",
                                                                        **SMALL_WS, **kw))
    return md, cache, cm


def test_hopper_non_causal_block_is_fused(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    case = make_case([9, 22], [4, 4], num_heads=8, causal=False, dtype=torch.float32)
    md, cache, cm = hopper_rank(case, 2, 1, 1)
    impl = FlashInferMLAImpl(num_heads=8, scale=case.scale)
    impl.forward_decode(case.q, cache, md.decode)
    (wrapper,) = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances
    assert wrapper.backend == "fa3"
    (plan,) = wrapper.plans
    meta = plan["metadata"]
    local = [brute_local_count(g, 2, 1, 1) for g in (9, 22)]  # [4, 11]
    assert meta.qo_indptr.tolist() == [0, 4, 8]
    assert meta.kv_len_arr.tolist() == local
    assert meta.kv_indptr.tolist() == [0, 1, 4]  # ceil(4/4)=1 and ceil(11/4)=3 pages
    table = cm.block_table_tensor
    assert meta.kv_indices.tolist() == table[0, :1].tolist() + table[1, :3].tolist()
    assert plan["causal"] is False and plan["num_heads"] == 8 and plan["page_size"] == 4
    assert plan["head_dim_ckv"] == 512 and plan["head_dim_kpe"] == 64
    assert plan["lse_mode"] == "basee" and plan["sm_scale"] == pytest.approx(case.scale)
    (run,) = wrapper.runs
    assert run["return_lse"] is True and run["return_lse_base_on_e"] is True


def test_hopper_causal_under_dcp_plans_runs_of_equal_visible_counts(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    # N=4, I=1, rank 0, G=[10, 13], Q=3: visible globals 8,9,10 and 11,12,13
    case = make_case([10, 13], [3, 3], num_heads=4, causal=True, dtype=torch.float32)
    counts = [[brute_local_count(g, 4, 0, 1) for g in range(G - 2, G + 1)] for G in (10, 13)]
    assert counts == [[2, 3, 3], [3, 3, 4]]
    for mode, expected_qo, expected_kv in [
            ("runs", [0, 1, 3, 5, 6], [2, 3, 3, 4]),
            ("flattened", [0, 1, 2, 3, 4, 5, 6], [2, 3, 3, 3, 3, 4])]:
        fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances = []
        md, cache, _ = hopper_rank(case, 4, 0, 1, causal_mode=mode)
        FlashInferMLAImpl(num_heads=4, scale=case.scale).forward_decode(case.q, cache, md.decode)
        (plan,) = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances[0].plans
        assert plan["causal"] is False, mode
        assert plan["metadata"].qo_indptr.tolist() == expected_qo, mode
        assert plan["metadata"].kv_len_arr.tolist() == expected_kv, mode


def test_hopper_causal_at_dcp1_uses_causal_kernel(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    case = make_case([10, 13], [3, 3], num_heads=4, causal=True, dtype=torch.float32)
    md, cache, _ = hopper_rank(case, 1, 0, 1)
    FlashInferMLAImpl(num_heads=4, scale=case.scale).forward_decode(case.q, cache, md.decode)
    (plan,) = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances[0].plans
    assert plan["causal"] is True
    assert plan["metadata"].qo_indptr.tolist() == [0, 3, 6]
    assert plan["metadata"].kv_len_arr.tolist() == [10, 13]


def test_hopper_plan_is_made_once_per_step_and_reused_across_layers(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    case = make_case([9, 22], [1, 1], num_heads=4, causal=True, dtype=torch.float32)
    md, cache, cm = hopper_rank(case, 1, 0, 1)
    impl = FlashInferMLAImpl(num_heads=4, scale=case.scale)
    for _layer in range(3):
        impl.forward_decode(case.q, cache, md.decode)
    (wrapper,) = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances
    assert len(wrapper.plans) == 1 and len(wrapper.runs) == 3


# the causal plan mode only matters for multi-token causal rows ("verify", "varlen")
PLAN_VARIANTS = ([(k, m, e) for k in ("verify", "varlen")
                  for m, e in [("auto", True), ("runs", True), ("runs", False), ("flattened", True)]]
                 + [(k, m, e) for k in ("single", "block") for m, e in [("auto", True),
                                                                       ("runs", False)]])


@pytest.mark.parametrize("n,interleave", [(1, 1), (2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("kind,mode,natural_lse", PLAN_VARIANTS)
def test_hopper_plans_compute_the_exact_answer(monkeypatch, kind, n, interleave, mode,
                                               natural_lse):
    """Executing the planned CSR requests (brute force) and merging ranks equals the oracle."""
    fake_flashinfer.install(monkeypatch)
    seq_lens, qlens, causal = {
        "single": ([3, 17, 40], [1, 1, 1], True),
        "verify": ([6, 17, 40], [4, 4, 4], True),
        "varlen": ([6, 17, 40], [2, 5, 1], True),
        "block": ([3, 17, 40], [4, 4, 4], False)}[kind]
    case = make_case(seq_lens, qlens, num_heads=4, causal=causal, seed=n + 7 * interleave)
    parts = []
    for r in range(n):
        md, cache, _ = hopper_rank(case, n, r, interleave, causal_mode=mode,
                                   natural_lse=natural_lse)
        parts.append(FlashInferMLAImpl(num_heads=4, scale=case.scale)
                     .forward_decode(case.q, cache, md.decode))
    out, lse = merge_attn_states(torch.stack([p[0] for p in parts]),
                                 torch.stack([p[1].double() for p in parts]))
    ref_out, ref_lse = reference_decode(case)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)
    wrapper = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances[0]
    assert wrapper.plans[0]["lse_mode"] == ("basee" if natural_lse else "base2")


def test_lse_conversion_factor_is_ln2(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    case = make_case([9], [1], num_heads=2, causal=True, dtype=torch.float32)
    results = {}
    for natural in (True, False):
        fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances = []
        md, cache, _ = hopper_rank(case, 1, 0, 1, natural_lse=natural)
        impl = FlashInferMLAImpl(num_heads=2, scale=case.scale)
        results[natural] = impl.forward_decode(case.q, cache, md.decode)[1]
        raw_run = fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances[0].runs[0]
        assert raw_run["return_lse_base_on_e"] is natural
    torch.testing.assert_close(results[False], results[True], rtol=1e-6, atol=1e-6)
    assert math.isclose(math.log(2.0), 0.6931471805599453)


def test_hopper_empty_rows_are_pinned_to_zero_and_minus_inf(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.garbage_for_empty = True
    # N=8, rank 7: G=3 and the first row of the G=9 block (visible 7) hold nothing here
    case = make_case([3, 9], [1, 3], num_heads=2, causal=True)
    md, cache, _ = hopper_rank(case, 8, 7, 1)
    assert md.decode.row_seq_lens.tolist() == [0, 0, 1, 1]
    out, lse = FlashInferMLAImpl(num_heads=2, scale=case.scale).forward_decode(
        case.q, cache, md.decode)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == float("-inf"))
    assert torch.isfinite(out[2:]).all() and torch.isfinite(lse[2:]).all()


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([2, 3, 4, 8]), q_len=st.integers(1, 24), g_extra=st.integers(1, 200),
       rank_seed=st.integers(0, 7))
def test_run_grouping_bound_and_cover(n, q_len, g_extra, rank_seed):
    """Runs cover the block's rows in order with their own counts; at I=1 there are at most
    ceil(Q/N)+1 of them (DESIGN §5)."""
    rank = rank_seed % n
    g = q_len + g_extra
    counts = [brute_local_count(g - (q_len - 1 - j), n, rank, 1) for j in range(q_len)]
    runs = _segments_of_block(counts, "runs")
    assert len(runs) <= -(-q_len // n) + 1
    assert [c for rows, c in runs for _ in range(rows)] == counts
    assert _segments_of_block(counts, "flattened") == [(1, c) for c in counts]


def test_unsupported_dtype_is_an_error_not_a_fallback(monkeypatch):
    """float32 q/cache cannot run the kernels: a clear error naming the dtypes and the fix (no
    silent per-layer fallback to the reference backend)."""
    fake_flashinfer.install(monkeypatch, float_inputs=False)
    case = make_case([9, 30], [3, 3], num_heads=2, causal=True, dtype=torch.float32)
    md, cache, _ = hopper_rank(case, 2, 1, 1)
    with pytest.raises(ValueError, match="bf16/fp16.*TORCH_MLA"):
        FlashInferMLAImpl(num_heads=2, scale=case.scale).forward_decode(case.q, cache, md.decode)
    assert fake_flashinfer.FakeBatchMLAPagedAttentionWrapper.instances[0].runs == []


def test_metadata_from_another_builder_is_an_error(monkeypatch):
    """A layer whose group metadata came from another backend's builder is refused."""
    fake_flashinfer.install(monkeypatch)
    case = make_case([9, 30], [3, 3], num_heads=2, causal=True, dtype=torch.bfloat16)
    md, cache, _ = hopper_rank(case, 2, 1, 1)
    md.decode.backend_state = None
    with pytest.raises(ValueError, match=r"one\s+backend per group"):
        FlashInferMLAImpl(num_heads=2, scale=case.scale).forward_decode(case.q, cache, md.decode)
