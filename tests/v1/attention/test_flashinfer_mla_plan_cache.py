"""The FlashInfer MLA plan cache on the CPU (flashinfer_plan_cache.py): a graph wrapper keeps
every real plan by chunk structure, and lengths that reach a kept structure again take that
plan back on the device (an advance: no host build) or in a host build (no planner call).
Oracles: the plan model's fresh plan for the same lengths (tests/utils/flashinfer_mla_plan_model.py,
FlashInfer's MLAPlan modelled) must cut the KV at the same chunk boundaries, and the plan the
kernels read must cover every request exactly (assert_valid_plan); the kernels' page lists must
be what a host plan lists. The GPU test (test_flashinfer_mla_gpu.py) checks attention outputs."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.utils.call_probes import check_switch
from tests.utils.fake_flashinfer import PlanModelWrapper, plan_model_raw
from tests.utils.flashinfer_mla_plan_model import limit_of
from tests.utils.held_flashinfer_plan import (UPPER, expect_plan_for, held_plan,
                                              page_lists)
from vllm.v1.attention.backends.mla.flashinfer_host_plan import HOST_PLANS_FLAG
from vllm.v1.attention.backends.mla.flashinfer_mla import OWN_PLAN_COPY_FLAG
from vllm.v1.attention.backends.mla.flashinfer_plan_cache import (PLAN_CACHE_FLAG, PlanCache,
                                                                  plan_cache_enabled,
                                                                  single_request_lengths,
                                                                  structure_of)
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import chunk_count

# Another structure than UPPER's (request 1 in 10 chunks of 192, not 11), and lengths of
# UPPER's structure again (4, 11, 1, 1 chunks of 192) that were never planned.
OTHER = [708, 1900, 70, 12]
AGAIN = [720, 2060, 75, 13]  # (the block table is 129 pages of 16 wide)


@pytest.fixture(params=[False, True], ids=["draft-noncausal", "verify-causal"])
def cached(request, monkeypatch):
    return _cached(monkeypatch, request.param)


def _cached(monkeypatch, causal: bool):
    """A wrapper that planned UPPER then OTHER (both kept), the OTHER metadata held. Host
    plans (flashinfer_host_plan.py) are off: these tests are of plans FlashInfer's planner
    made and the cache kept (a structure the cache lacks then takes the native planner);
    tests/v1/attention/test_flashinfer_mla_host_plan.py has them on."""
    monkeypatch.setenv(HOST_PLANS_FLAG, "0")
    builder, md, ws, _, upper_cm = held_plan(monkeypatch, causal=causal)
    slot = md.decode.backend_state.wrapper_slot
    other_cm = replace(upper_cm, seq_lens_cpu=torch.tensor(OTHER, dtype=torch.int32))
    md_other = builder.build(0, other_cm)
    assert len(slot.refresher.cache) == 2, "each real plan is kept"
    return builder, md_other, ws, slot, upper_cm, causal


def test_an_advance_into_a_kept_structure_puts_its_plan_back(cached):
    """The held plan (OTHER's) does not fit AGAIN's chunk counts; UPPER's kept plan does: the
    advance puts it back on the device, rewrites the page lists there and writes the lengths,
    with no planner call and no host build, leaving a plan cut as a fresh one would be."""
    builder, md, ws, slot, _, causal = cached
    md.decode.seq_lens[:4] = torch.tensor(AGAIN)
    refresher = slot.refresher
    plans = (slot.native_replans, slot.full_plans)
    held_skeleton = refresher.skeleton
    if causal:
        assert builder.advance_graph_step(md, np.array(AGAIN, dtype=np.int32))
    else:
        bounds = np.array(AGAIN, dtype=np.int64)
        assert builder.advance_decode_plan_on_device(md, (bounds, bounds))
    assert (slot.native_replans, slot.full_plans) == plans
    assert refresher.cache_put_backs == 1 and refresher.skeleton is not held_skeleton
    assert refresher.page_list_rebuilds == 1  # the works' first pages are this step's
    backend = slot.wrapper._planned_backend
    indptr, indices = page_lists(md.decode.block_table, AGAIN)
    assert backend._kv_indptr_buf[:5].tolist() == indptr
    assert backend._kv_indices_buf[:indptr[-1]].tolist() == indices
    assert backend._kv_len_arr_buf[:4].tolist() == AGAIN
    assert not backend._kv_len_arr_buf[4:].any()
    expect_plan_for(md, ws, slot, AGAIN, causal, indptr)


def test_a_draft_range_takes_a_kept_plan_that_serves_all_of_it(monkeypatch):
    """A draft block's bounds (every draft rejected .. all accepted) whose lower end is of a
    kept structure take that plan where the upper end is within its last chunk's slack."""
    builder, md, ws, slot, _, causal = _cached(monkeypatch, causal=False)
    lower = np.array(AGAIN, dtype=np.int64)
    upper = lower + 4
    md.decode.seq_lens[:4] = torch.tensor(AGAIN) + 2  # the device's exact lengths
    assert builder.advance_decode_plan_on_device(md, (lower, upper))
    assert slot.refresher.cache_put_backs == 1
    lengths = (lower + 2).tolist()
    indptr, _ = page_lists(md.decode.block_table, lengths)
    expect_plan_for(md, ws, slot, lengths, causal, indptr)


def test_a_kept_plan_takes_this_steps_page_lists(cached):
    """The held plan lists more pages than the new lengths need (no page-list rebuild of its
    own would happen), but the kept plan's works point at the first pages of the CSR it was
    planned with: the put-back rewrites the lists, so the works and the CSR agree."""
    builder, _, ws, slot, upper_cm, causal = cached
    wide = [900, 1900, 70, 12]  # 57, 119, 5, 1 pages; 5 chunks for request 0
    md = builder.build(0, replace(upper_cm, seq_lens_cpu=torch.tensor(wide, dtype=torch.int32)))
    lengths = [700, 1890, 70, 12]  # OTHER's structure, within the listed pages
    md.decode.seq_lens[:4] = torch.tensor(lengths)
    if causal:
        assert builder.advance_graph_step(md, np.array(lengths, dtype=np.int32))
    else:
        bounds = np.array(lengths, dtype=np.int64)
        assert builder.advance_decode_plan_on_device(md, (bounds, bounds))
    assert slot.refresher.cache_put_backs == 1
    indptr, _ = page_lists(md.decode.block_table, lengths)
    assert slot.wrapper._planned_backend._kv_indptr_buf[:5].tolist() == indptr
    expect_plan_for(md, ws, slot, lengths, causal, indptr)


def test_a_build_for_a_kept_structure_refreshes_its_plan_without_the_planner(cached):
    """The host build path (a step that could not advance): a kept plan of the step's
    structure is put back and refreshed for the host lengths instead of FlashInfer planning."""
    builder, md, ws, slot, upper_cm, causal = cached
    plans = (slot.native_replans, slot.full_plans)
    md_again = builder.build(0, replace(upper_cm,
                                        seq_lens_cpu=torch.tensor(AGAIN, dtype=torch.int32)))
    assert (slot.native_replans, slot.full_plans) == plans
    assert slot.refresher.cache_put_backs == 1
    csr = md_again.decode.backend_state.hopper_inputs.arrays[1]
    expect_plan_for(md_again, ws, slot, AGAIN, causal, csr[:5].tolist())


def test_a_structure_never_planned_is_refused_and_then_kept(cached):
    """Lengths of a third structure: the advance is refused, changing nothing; the build
    plans for real and keeps the plan, so a later advance into it puts it back."""
    builder, md, ws, slot, upper_cm, causal = cached
    third = [900, 2000, 70, 12]  # request 0 in 5 chunks (past a draft plan's slack too)
    md.decode.seq_lens[:4] = torch.tensor(third)
    before = ws.clone()
    bounds = np.array(third, dtype=np.int64)
    advance = (lambda m, g: builder.advance_graph_step(m, g.astype(np.int32))) if causal else (
        lambda m, g: builder.advance_decode_plan_on_device(m, (g, g)))
    assert not advance(md, bounds)
    assert torch.equal(ws, before) and slot.refresher.cache_put_backs == 0
    replans = slot.native_replans
    md_third = builder.build(0, replace(upper_cm, seq_lens_cpu=torch.tensor(third,
                                                                        dtype=torch.int32)))
    assert slot.native_replans == replans + 1 and len(slot.refresher.cache) == 3
    # back to UPPER's structure from the third plan, then to the third again: both kept
    for lengths in (UPPER, [901, 2001, 71, 13]):
        md_third.decode.seq_lens[:4] = torch.tensor(lengths)
        assert advance(md_third, np.array(lengths, dtype=np.int64))
        indptr, _ = page_lists(md_third.decode.block_table, lengths)
        expect_plan_for(md_third, ws, slot, lengths, causal, indptr)
    assert slot.refresher.cache_put_backs == 2 and slot.native_replans == replans + 1


def test_without_the_cache_the_advance_is_refused_and_the_build_plans(monkeypatch):
    monkeypatch.setenv(PLAN_CACHE_FLAG, "0")
    builder, md, ws, _, upper_cm = held_plan(monkeypatch, causal=False)
    slot = md.decode.backend_state.wrapper_slot
    assert slot.refresher.cache is None
    md_other = builder.build(0, replace(upper_cm,
                                        seq_lens_cpu=torch.tensor(OTHER, dtype=torch.int32)))
    md_other.decode.seq_lens[:4] = torch.tensor(UPPER)
    bounds = np.array(UPPER, dtype=np.int64)
    assert not builder.advance_decode_plan_on_device(md_other, (bounds, bounds))
    replans = slot.native_replans
    builder.build(0, upper_cm)
    assert slot.native_replans == replans + 1


def test_the_switch(monkeypatch):
    check_switch(monkeypatch, PLAN_CACHE_FLAG, plan_cache_enabled, default=True)


def test_structure_of_is_the_planner_cut():
    """Brute force over lengths and cluster counts: the limit is MLAPlan's (the plan model's
    limit_of) and each count is the number of chunks of at most that limit."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 5000, size=int(rng.integers(1, 9)))
        clusters = int(rng.choice([66, 132, 8]))
        limit, counts = structure_of(lengths, clusters)
        assert limit == limit_of(int(lengths.sum()), clusters)
        assert counts == tuple(max(1, -(-int(g) // limit)) for g in lengths)
        assert counts == tuple(chunk_count(int(g), limit) for g in lengths)


class _Skeleton:
    """What PlanCache reads of a skeleton."""

    def __init__(self, lengths, clusters=66, slack=0, qo=b"rows"):
        self.limit, self.counts = structure_of(np.array(lengths), clusters)
        c = np.array(self.counts)
        self.lo = np.where(c > 1, (c - 1) * self.limit, -1)
        self.hi = c * self.limit + slack
        self.qo_bytes, self.num_works, self.info = qo, int(c.sum()), None


def _store(cache: PlanCache, skeleton: _Skeleton) -> None:
    # int positions: field i of PLAN_INFO_FIELDS[2:16] at 100 * i (per-work arrays at 0, 100,
    # 200, 800, ..., 1200, work_indptr at 1300), the merge arrays moved to 1500 + 2m
    info = [1, 2] + [i * 100 * 4 for i in range(14)] + [0, 0]
    info[5:10] = [1500 * 4 + i * 8 for i in range(5)]
    info = [int(v) for v in info]
    ws = torch.arange(4000, dtype=torch.int32).view(torch.uint8)
    cache.store(skeleton, tuple(info), ws, torch.device("cpu"))


def test_find_serves_a_verify_plan_only_its_own_structure():
    cache = PlanCache()
    _store(cache, _Skeleton([100, 40]))  # limit 32 at 66 clusters: 4 and 2 chunks
    lower = np.array([97, 33])
    assert cache.find(b"rows", lower, lower, 66, draft=False) is not None
    assert cache.find(b"other rows", lower, lower, 66, draft=False) is None
    # a range that crosses request 0's chunk edge (128) is two structures: refused
    assert cache.find(b"rows", lower, np.array([129, 33]), 66, draft=False) is None
    assert cache.find(b"rows", lower, np.array([128, 33]), 66, draft=False) is not None


def test_find_serves_a_draft_range_within_the_slack():
    cache = PlanCache()
    _store(cache, _Skeleton([100, 40], slack=32))  # hi: 160, 96
    lower = np.array([97, 33])
    assert cache.find(b"rows", lower, np.array([160, 96]), 66, draft=True) is not None
    assert cache.find(b"rows", lower, np.array([161, 96]), 66, draft=True) is None


def test_the_cache_keeps_its_capacity_least_recently_used_first():
    cache = PlanCache(capacity=2)
    for lengths in ([10], [40], [70]):  # 1, 2, 3 chunks of 32
        _store(cache, _Skeleton(lengths))
    assert len(cache) == 2
    assert cache.find(b"rows", np.array([10]), np.array([10]), 66, draft=False) is None
    assert cache.find(b"rows", np.array([40]), np.array([40]), 66, draft=False) is not None
    _store(cache, _Skeleton([100]))  # drops [70]'s, the least recently found
    assert cache.find(b"rows", np.array([70]), np.array([70]), 66, draft=False) is None
    assert cache.find(b"rows", np.array([40]), np.array([40]), 66, draft=False) is not None


def test_put_back_writes_exactly_the_kept_regions():
    """The image is the plan's values at the regions the kernels read; put_back writes
    those and nothing else."""
    cache = PlanCache()
    skeleton = _Skeleton([100, 40])
    _store(cache, skeleton)
    entry = cache.find(b"rows", np.array([100, 40]), np.array([100, 40]), 66, draft=False)
    target = torch.full((4000,), -1, dtype=torch.int32)
    PlanCache.put_back(entry, target.view(torch.uint8))
    written = (target != -1).nonzero().flatten().tolist()
    works = skeleton.num_works  # 6
    expected = sorted({i * 100 + w for i in (0, 1, 2, 8, 9, 10, 11, 12) for w in range(works)}
                      | {1500 + 2 * m + j for m in range(5) for j in range(2)}
                      | {1300 + c for c in range(3)})  # work_indptr: clusters (2) + 1
    assert written == expected
    assert torch.equal(target[written], torch.tensor(written, dtype=torch.int32))


class _WithJitPlanner(PlanModelWrapper):
    raw = staticmethod(plan_model_raw)


@pytest.mark.parametrize("causal", [False, True], ids=["draft-noncausal", "verify-causal"])
def test_a_lone_request_layout_plans_every_structure_once(monkeypatch, causal):
    """The first real plan of a one-request layout plans every structure a lone request
    reaches up to the model's length, leaving the device workspace with the live plan; the
    request then grows through all of them (3 tokens a step, as a DSpark request) by device
    advances alone: no planner call, a put-back at every structure change, and each step's
    plan cut as a fresh plan of its lengths."""
    monkeypatch.setenv(OWN_PLAN_COPY_FLAG, "0")  # (the CPU has no pinned scratch to copy from)
    builder, md, ws, _, _ = held_plan(monkeypatch, causal, wrapper_cls=_WithJitPlanner,
                                      max_model_len=512, exact=[500], upper=[96])
    slot = md.decode.backend_state.wrapper_slot
    refresher = slot.refresher
    clusters = refresher.skeleton.num_clusters
    assert len(refresher.cache) == len(single_request_lengths(512, clusters))
    expect_plan_for(md, ws, slot, [96], causal, [0, 6])  # still the live plan
    plans = (slot.native_replans, slot.full_plans)
    changes, previous = 0, structure_of(np.array([96]), clusters)
    for length in range(99, 513, 3):
        md.decode.seq_lens[0] = length
        bounds = np.array([length], dtype=np.int64)
        if causal:
            assert builder.advance_graph_step(md, bounds.astype(np.int32)), length
        else:
            assert builder.advance_decode_plan_on_device(md, (bounds, bounds)), length
        indptr, _ = page_lists(md.decode.block_table, [length])
        expect_plan_for(md, ws, slot, [length], causal, indptr, exact_cut=causal)
        now = structure_of(bounds, clusters)
        changes += now != previous
        previous = now
    assert (slot.native_replans, slot.full_plans) == plans
    # a draft plan's slack lets it skip some changes; a verify plan takes every one
    assert 0 < refresher.cache_put_backs <= changes
    if causal:
        assert refresher.cache_put_backs == changes


@pytest.mark.parametrize("dcp", [1, 2])
def test_only_dcp1_graph_wrappers_keep_plans(monkeypatch, dcp):
    """DCP > 1 keeps no plans (its put-backs have not run on two GPUs): its graph wrappers
    re-plan at every new chunk structure, as before the cache."""
    from types import SimpleNamespace

    from tests.utils.fake_flashinfer import install_native_replan
    from tests.utils.mla_dcp_helpers import mla_spec, parallel_config
    from vllm.v1.attention.backends.mla import flashinfer_mla as fm
    install_native_replan(monkeypatch, PlanModelWrapper)
    config = SimpleNamespace(parallel_config=parallel_config(dcp).parallel_config,
                             model_config=SimpleNamespace(max_model_len=512), max_num_seqs=4)
    builder = fm.FlashInferMLAMetadataBuilder(mla_spec(16, True, torch.float32), ["layer.0"],
                                              config, "cpu", dcp_rank=0, kernel_family="hopper")
    slot = builder._get_graph_wrapper_slot(4)
    assert slot.keeps_plans == (dcp == 1)
    assert slot.max_kv_len == (512 if dcp == 1 else 0)
