"""FlashInferMLAMetadataBuilder.advance_decode_plan_on_device on the CPU: a CUDA-graph plan held
from one step carries the next (the early draft step with the device lowering,
BlockSpeculator.prepare_early) where its listed pages, page ids and chunk counts still hold;
it then writes the new lengths from the device buffer, leaving the int workspace as a host
refresh for those lengths would and the wrapper's kv_len_arr at them. Anything else is refused
and changes nothing. The wrapper is the plan-model stand-in (tests/utils/fake_flashinfer.py:
real plan layouts, FlashInfer's planner modelled), so skeletons and refreshes are the GPU's;
the GPU test (test_flashinfer_mla_gpu.py) checks the attention output itself."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from tests.utils.call_probes import check_switch
from tests.utils.held_flashinfer_plan import EXACT, Q, UPPER, held_plan, page_lists
from vllm.v1.attention.backends.mla.flashinfer_host_plan import HOST_PLANS_FLAG
from vllm.v1.attention.backends.mla.flashinfer_mla import PAGE_LIST_REBUILD_FLAG
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import PlanRefresher

# The plan is made one step earlier for UPPER (that step's bound); this step's device lengths
# are EXACT (past UPPER for every request), its bounds [LOWER, NEXT_UPPER] keep every request
# in the pages listed for UPPER (45, 129, 5, 1 pages of 16) and in its chunk count.
LOWER = [712, 2056, 74, 12]
NEXT_UPPER = [716, 2060, 78, 16]


@pytest.fixture
def held(monkeypatch):
    """(builder, metadata planned for UPPER with the device lengths at EXACT, the int
    workspace as int32, a host refresh of that workspace for lengths -> its bytes, the
    metadata input that planned it)."""
    return held_plan(monkeypatch, causal=False)


def _bounds(lower=LOWER, upper=NEXT_UPPER):
    return np.array(lower, dtype=np.int64), np.array(upper, dtype=np.int64)


def test_an_advance_writes_what_a_host_refresh_writes(held):
    builder, md, ws, host_refresh, _ = held
    expected = host_refresh(EXACT)
    assert not torch.equal(ws, expected)  # the held plan is at UPPER
    assert builder.advance_decode_plan_on_device(md, _bounds())
    assert torch.equal(ws, expected)
    kv_len_arr = md.decode.backend_state.wrapper_slot.wrapper._planned_backend._kv_len_arr_buf
    assert kv_len_arr[:4].tolist() == EXACT and not kv_len_arr[4:].any()
    assert md.decode.row_seq_lens_cpu is None  # the host rows of the earlier step are stale


@pytest.mark.parametrize("written", [True, False])
@pytest.mark.parametrize("why", ["lengths only", "a page the plan does not list"])
def test_a_fused_advance_hands_its_device_work_to_the_lengths_write(held, why, written):
    """advance_decode_plan_on_device with a FusedDraftLowering (a block drafter's early step
    asks BEFORE its input write): the host checks pass as without it, but nothing that reads
    this step's lengths runs yet; the lowering is handed over for the write to perform, a
    page-list rebuild waits in `after`. Once the lengths are written (here by hand, as the
    write's torch twin does) and the collector finished, the plan equals the immediate
    advance's: the same lists and work arrays (a host refresh's), kv_len_arr at the lengths.
    `written=False`: the write did not take the lowering (a later group refused), so finish
    launches it itself, with the same result."""
    from vllm.v1.attention.backends.mla.plan_lowering import FusedDraftLowering
    builder, md, ws, _, _ = held
    refresher = md.decode.backend_state.wrapper_slot.refresher
    lengths = list(EXACT)
    if why == "a page the plan does not list":
        lengths[2] = 81  # 6 pages of 16: the plan lists 5 for request 2
    bounds = (np.array(lengths, dtype=np.int64), np.array(lengths, dtype=np.int64))
    seq_lens = md.decode.seq_lens
    seq_lens[:4] = 0  # the write has not run yet: nothing may read these
    before, rebuilds = ws.clone(), refresher.page_list_rebuilds
    fuse = FusedDraftLowering(seq_lens, 4)
    assert builder.advance_decode_plan_on_device(md, bounds, fuse=fuse)
    assert torch.equal(ws, before) and refresher.page_list_rebuilds == rebuilds
    lowering = fuse.lowering()
    assert lowering is not None and lowering.num_reqs == 4
    assert len(fuse.after) == (1 if why != "lengths only" else 0)
    seq_lens[:4] = torch.tensor(lengths, dtype=seq_lens.dtype)  # the write
    if written:
        lowering.apply_torch(seq_lens)
    fuse.finish(written=written)
    assert refresher.page_list_rebuilds == rebuilds + (why != "lengths only")
    _expect_lists_and_lengths(md, ws, refresher, lengths if why != "lengths only" else UPPER,
                              lengths)
    kv_len_arr = md.decode.backend_state.wrapper_slot.wrapper._planned_backend._kv_len_arr_buf
    assert kv_len_arr[:4].tolist() == lengths


def test_a_fused_advance_of_other_lengths_launches_its_own_lowering(held):
    """A plan whose lengths are not the write's rows (another buffer) is not lowered by the
    write: its lowering waits in `after`, reading its own lengths."""
    from vllm.v1.attention.backends.mla.plan_lowering import FusedDraftLowering
    builder, md, ws, host_refresh, _ = held
    fuse = FusedDraftLowering(torch.zeros(8, dtype=torch.int32), 4)
    assert builder.advance_decode_plan_on_device(md, _bounds(), fuse=fuse)
    assert fuse.lowering() is None and len(fuse.after) == 1
    fuse.finish(written=False)
    assert torch.equal(ws, host_refresh(EXACT))


@pytest.mark.parametrize("why", ["under a chunk edge", "a later build"])
def test_a_refused_advance_changes_nothing(held, why):
    builder, md, ws, _, upper_cm = held
    lower, upper = _bounds()
    slot = md.decode.backend_state.wrapper_slot
    if why == "under a chunk edge":
        skeleton = slot.refresher.skeleton
        multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
        assert multi, "request 1 (2053 tokens) spans several chunks"
        lower[multi[0]] = int(skeleton.lo[multi[0]])
    else:  # the wrapper planned again since: md is not its latest plan
        builder.build(0, upper_cm)
    before = ws.clone()
    lowerings = slot.refresher.device_lowerings
    assert not builder.advance_decode_plan_on_device(md, (lower, upper))
    if why != "a later build":
        assert torch.equal(ws, before)
    assert slot.refresher.device_lowerings == lowerings


@pytest.mark.parametrize("why", ["a page the plan does not list", "other pages in a row"])
def test_an_advance_past_the_listed_pages_rebuilds_them_on_the_device(held, why):
    """Where a request grew into a page the held plan does not list, or a row's pages are
    not the listed ones any more, the chunks still hold: the advance writes the page lists
    from the device block table and lengths (one launch on CUDA) before the lengths. The
    kernels' CSR then lists what a host plan would, the work arrays equal a host refresh
    for those lists and lengths, and the host arrays are marked stale (host refreshes of
    that staged set are refused; later advances check against the rebuilt lists, below)."""
    builder, md, ws, _, _ = held
    state = md.decode.backend_state
    refresher = state.wrapper_slot.refresher
    lengths = list(EXACT)
    if why == "a page the plan does not list":
        lengths[2] = 81  # 6 pages of 16: the plan lists 5 for request 2
        md.decode.seq_lens[2] = 81
    else:
        md.decode.block_table[1, 3] += 1000  # the device rows: what the kernels read
        md.decode.block_table_cpu[1, 3] += 1000  # and their host twin, both current
    bounds = (np.array(lengths, dtype=np.int64), np.array(lengths, dtype=np.int64))
    qo = state.hopper_inputs.arrays[0]
    kv = np.zeros(qo.shape[0] - 1, dtype=np.int32)
    kv[:4] = lengths
    assert refresher.skeleton.fits(qo, kv)  # the chunks hold: only the page lists change
    rebuilds = refresher.page_list_rebuilds
    assert builder.advance_decode_plan_on_device(md, bounds)
    assert refresher.page_list_rebuilds == rebuilds + 1
    assert state.hopper_inputs.host_csr_stale
    _expect_lists_and_lengths(md, ws, refresher, lengths, lengths)
    # the staged host arrays say nothing of the device lists now: no host lowering in place
    assert not builder.refresh_decode_seq_lens(md, np.array(lengths))


@pytest.mark.parametrize("why", ["a page the plan does not list", "other pages in a row"])
def test_without_the_page_list_rebuild_such_an_advance_is_refused(monkeypatch, why):
    """VLLM_PLAN_PAGE_LIST_REBUILD=0: the same two advances are refused and
    write nothing (the step builds on the host)."""
    builder, md, ws, _, _ = held_plan(monkeypatch, causal=False, rebuild=False)
    assert not builder.page_list_rebuild
    lengths = list(EXACT)
    if why == "a page the plan does not list":
        lengths[2] = 81
    else:
        md.decode.block_table_cpu[1, 3] += 1000
    bounds = (np.array(lengths, dtype=np.int64), np.array(lengths, dtype=np.int64))
    refresher = md.decode.backend_state.wrapper_slot.refresher
    before, lowerings = ws.clone(), refresher.device_lowerings
    assert not builder.advance_decode_plan_on_device(md, bounds)
    assert torch.equal(ws, before) and refresher.device_lowerings == lowerings
    assert refresher.page_list_rebuilds == 0


def _expect_lists_and_lengths(md, ws, refresher, listed_lengths, lengths):
    """The kernels' CSR lists the pages of `listed_lengths` over the current table rows, and
    the work arrays equal a host refresh for those lists and `lengths`."""
    state = md.decode.backend_state
    backend = state.wrapper_slot.wrapper._planned_backend
    indptr, indices = page_lists(md.decode.block_table, listed_lengths)
    assert backend._kv_indptr_buf[:5].tolist() == indptr
    assert backend._kv_indices_buf[: indptr[-1]].tolist() == indices
    qo = state.hopper_inputs.arrays[0]
    kv = np.zeros(qo.shape[0] - 1, dtype=np.int32)
    kv[:4] = lengths
    oracle = PlanRefresher(ws.clone(), max_works=refresher.max_works)
    oracle.adopt(refresher.skeleton)
    full_indptr = np.full(qo.shape[0], indptr[-1], dtype=np.int32)
    full_indptr[:5] = indptr
    assert oracle.try_refresh(qo, full_indptr, kv)
    assert torch.equal(ws, oracle.device_ws)


@pytest.mark.parametrize("case", ["same pages", "a page past the lists",
                                  "a listed page changed", "lists of a lower bound"])
def test_the_advance_after_a_rebuild_checks_against_the_rebuilt_lists(held, case):
    """After a device rebuild the host arrays no longer say what the device lists, so the
    next advance compares against what the rebuild wrote (`rebuilt_lists`): within those
    pages, with the rows' pages unchanged, it only writes the lengths (no second rebuild);
    a page past them, a changed page, or a first rebuild that only knew a lower bound of
    the lengths (fewer pages surely listed) rebuilds again. Either way the kernels' lists and
    work arrays are what a host plan and refresh would give."""
    builder, md, ws, _, _ = held
    refresher = md.decode.backend_state.wrapper_slot.refresher
    first = list(EXACT)
    first[2] = 81  # 6 pages of 16: the plan lists 5 for request 2, so this advance rebuilds
    md.decode.seq_lens[:4] = torch.tensor(first)
    lower = list(first)
    if case == "lists of a lower bound":
        lower[2] = 78  # the device may hold 78..81: only 5 pages of request 2 are sure
    assert builder.advance_decode_plan_on_device(md, _bounds(lower, first))
    assert refresher.page_list_rebuilds == 1
    second = [714, 2058, 83, 16]  # request 2 still in 6 pages, the others in theirs
    listed = list(second)
    if case == "a page past the lists":
        second[2] = listed[2] = 97  # 7 pages
    elif case == "a listed page changed":
        md.decode.block_table[0, 2] += 1000
        md.decode.block_table_cpu[0, 2] += 1000
    elif case == "same pages":
        listed = first  # no rebuild: the lists stay the first advance's
    md.decode.seq_lens[:4] = torch.tensor(second)
    lowerings = refresher.device_lowerings
    assert builder.advance_decode_plan_on_device(md, _bounds(second, second))
    assert refresher.page_list_rebuilds == (1 if case == "same pages" else 2)
    assert refresher.device_lowerings == lowerings + 1
    _expect_lists_and_lengths(md, ws, refresher, listed, second)


@pytest.mark.parametrize("case", ["rows hold pages ahead", "the switch off",
                                  "a row holds none ahead"])
def test_a_rebuild_lists_the_pages_the_rows_hold_ahead(monkeypatch, case):
    """VLLM_PLAN_PAGE_LIST_LOOKAHEAD: a device rebuild lists, past every length, the pages
    of as many tokens as the row holding the fewest pages ahead of its upper bound holds
    (here 8: request 1 holds 129 pages, 2064 tokens, at 2056), so a next advance that grew
    into them (request 3 from 14 to 17 tokens: a second page) writes only the lengths. With
    the switch off, or a row that holds no page ahead (nothing may be listed past its own,
    whose ids are stale), each length lists its own pages and that advance rebuilds again.
    Either way the lists and work arrays are a host plan's and refresh's for the listed
    lengths."""
    from vllm.v1.attention.backends.mla.flashinfer_mla import PAGE_LIST_LOOKAHEAD_FLAG
    monkeypatch.setenv(PAGE_LIST_LOOKAHEAD_FLAG, "0" if case == "the switch off" else "1")
    builder, md, ws, _, _ = held_plan(monkeypatch, causal=False)
    refresher = md.decode.backend_state.wrapper_slot.refresher
    held = np.array([47, 129, 7, 3 if case != "a row holds none ahead" else 1], np.int32)
    for r, count in enumerate(held):  # the rows' allocated pages past their lengths' own
        for p in range(-(-EXACT[r] // 16), int(count)):
            md.decode.block_table[r, p] = md.decode.block_table_cpu[r, p] = 300 + 8 * r + p
    md.decode.num_blocks_cpu = held
    ahead = 0 if case != "rows hold pages ahead" else 8
    first = [712, 2056, 81, 14]  # request 2 past the 5 pages the plan lists: a rebuild
    md.decode.seq_lens[:4] = torch.tensor(first)
    assert builder.advance_decode_plan_on_device(md, _bounds(first, first))
    assert refresher.page_list_rebuilds == 1
    _expect_lists_and_lengths(md, ws, refresher, [g + ahead for g in first], first)
    second = [714, 2058, 85, 17]
    md.decode.seq_lens[:4] = torch.tensor(second)
    assert builder.advance_decode_plan_on_device(md, _bounds(second, second))
    assert refresher.page_list_rebuilds == (1 if ahead else 2)
    _expect_lists_and_lengths(md, ws, refresher,
                              [g + ahead for g in first] if ahead else second, second)


def test_the_lookahead_switch(monkeypatch):
    from vllm.v1.attention.backends.mla.flashinfer_mla import (PAGE_LIST_LOOKAHEAD_FLAG,
                                                               page_list_lookahead_enabled)
    check_switch(monkeypatch, PAGE_LIST_LOOKAHEAD_FLAG, page_list_lookahead_enabled,
                 default=True)


def test_without_a_host_table_twin_every_advance_past_the_lists_rebuilds(held):
    """Metadata without the host block table (no twin to compare pages against) still
    advances by rebuilding the lists on the device, and keeps no record of them: the next
    advance rebuilds again."""
    builder, md, ws, _, _ = held
    refresher = md.decode.backend_state.wrapper_slot.refresher
    md.decode.block_table_cpu = None
    for step, lengths in enumerate(([712, 2056, 81, 14], [713, 2057, 82, 15]), start=1):
        md.decode.seq_lens[:4] = torch.tensor(lengths)
        assert builder.advance_decode_plan_on_device(md, _bounds(lengths, lengths))
        assert refresher.page_list_rebuilds == step
        assert md.decode.backend_state.hopper_inputs.rebuilt_lists is None
        _expect_lists_and_lengths(md, ws, refresher, lengths, lengths)


def test_a_page_changed_after_an_advance_is_seen_by_the_next(held):
    """The page comparison's positions and listed ids are made once per plan (the first
    advance) and reused: a row that holds another page by the next advance is still caught
    (rebuilt here), not compared against what the first advance saw."""
    builder, md, ws, _, _ = held
    refresher = md.decode.backend_state.wrapper_slot.refresher
    assert builder.advance_decode_plan_on_device(md, _bounds())
    assert refresher.page_list_rebuilds == 0
    assert md.decode.backend_state.hopper_inputs.page_check is not None
    md.decode.block_table[1, 3] += 1000
    md.decode.block_table_cpu[1, 3] += 1000
    second = [714, 2058, 76, 15]
    md.decode.seq_lens[:4] = torch.tensor(second)
    assert builder.advance_decode_plan_on_device(md, _bounds(second, second))
    assert refresher.page_list_rebuilds == 1
    _expect_lists_and_lengths(md, ws, refresher, second, second)


def test_the_switch(monkeypatch):
    """On by default since its GPU tests passed (test_flashinfer_mla_gpu.py)."""
    from vllm.v1.attention.backends.mla.flashinfer_mla import page_list_rebuild_enabled
    check_switch(monkeypatch, PAGE_LIST_REBUILD_FLAG, page_list_rebuild_enabled, default=True)


def test_the_same_step_lowering_shares_the_checks(held):
    """lower_decode_seq_lens_on_device (the plan built for this step's upper bound) is the
    advance with the planned lengths as the upper bound: a lower bound under them writes the
    device lengths as a host refresh would; one above them is refused, writing nothing."""
    builder, md, ws, host_refresh, _ = held
    before = ws.clone()
    assert not builder.lower_decode_seq_lens_on_device(md, np.array([709, 2053, 70, 12]))
    assert torch.equal(ws, before)
    assert builder.lower_decode_seq_lens_on_device(md, np.array([704, 2049, 66, 8]))
    assert torch.equal(ws, host_refresh(EXACT))


# A target step's graph plan carried to the next step (advance_graph_step, the runner's
# _advance_graph_step): this step's exact lengths, one more token per request, still in the
# pages listed for UPPER (45, 129, 5, 1) and in every chunk.
NEXT = [713, 2057, 75, 15]


@pytest.fixture(params=[True, False], ids=["verify-causal", "draft-noncausal"])
def held_step(request, monkeypatch):
    return held_plan(monkeypatch, causal=request.param), request.param


def _rows_of(lengths, causal: bool) -> list[int]:
    """Every query row's visible KV count (DESIGN §2): row j of a causal block of Q sees
    G - (Q - 1 - j) tokens, every non-causal row the whole G."""
    return [g - (Q - 1 - j) if causal else g for g in lengths for j in range(Q)]


@pytest.mark.parametrize("crossing", [False, True], ids=["same-pages", "into-a-new-page"])
def test_a_graph_step_advance_writes_the_lengths_a_build_would(held_step, crossing):
    """The next step's lengths, put into the device buffer the metadata aliases (as the batch
    builder does): the advance leaves the work arrays as a host refresh for them (and for the
    page lists a host plan would make), the wrapper's kv_len_arr at them and every query
    row's visible count at its geometry. Into a new page: request 2 reaches 81 tokens, 6
    pages of 16 where the plan lists 5, and the lists are rebuilt on the device."""
    (builder, md, ws, _, _), causal = held_step
    lengths = list(NEXT)
    if crossing:
        lengths[2] = 81
    md.decode.seq_lens[:4].copy_(torch.tensor(lengths, dtype=md.decode.seq_lens.dtype))
    assert md.decode.row_seq_lens[:4 * Q].tolist() != _rows_of(lengths, causal)
    state = md.decode.backend_state
    refresher = state.wrapper_slot.refresher
    lowerings, rebuilds = refresher.device_lowerings, refresher.page_list_rebuilds
    oracle = PlanRefresher(ws.clone(), max_works=refresher.max_works)
    oracle.adopt(refresher.skeleton)
    qo = state.hopper_inputs.arrays[0]
    kv = np.zeros(qo.shape[0] - 1, dtype=np.int32)
    kv[:4] = lengths
    indptr, _ = page_lists(md.decode.block_table, lengths)
    full_indptr = np.full(qo.shape[0], indptr[-1], dtype=np.int32)
    full_indptr[:5] = indptr
    assert oracle.try_refresh(qo, full_indptr, kv)
    assert builder.advance_graph_step(md, np.array(lengths, dtype=np.int32))
    assert torch.equal(ws, oracle.device_ws)
    kv_len_arr = state.wrapper_slot.wrapper._planned_backend._kv_len_arr_buf
    assert kv_len_arr[:4].tolist() == lengths and not kv_len_arr[4:].any()
    assert md.decode.row_seq_lens[:4 * Q].tolist() == _rows_of(lengths, causal)
    assert refresher.device_lowerings == lowerings + 1
    assert refresher.page_list_rebuilds == rebuilds + int(crossing)


@pytest.mark.parametrize("causal", [True, False], ids=["verify-causal", "draft-noncausal"])
@pytest.mark.parametrize("why", ["a later build", "under a chunk edge"])
def test_a_refused_graph_step_advance_changes_nothing(monkeypatch, causal, why):
    """Refused where the held state is no longer the builder's latest (any build since
    rewrote its row buffers or plans) or the lengths leave the plan's pages or chunks (with
    no plan of their chunk structure to be had: the plan cache holds none and host plans,
    flashinfer_host_plan.py, are off; with them on such an advance takes a host plan,
    tests/v1/attention/test_flashinfer_mla_host_plan.py); the device buffers keep what they
    held (the runner then builds)."""
    monkeypatch.setenv(HOST_PLANS_FLAG, "0")
    builder, md, ws, _, upper_cm = held_plan(monkeypatch, causal=causal)
    lengths = np.array(NEXT, dtype=np.int32)
    if why == "a later build":
        builder.build(0, upper_cm)
    else:
        skeleton = md.decode.backend_state.wrapper_slot.refresher.skeleton
        multi = [i for i in range(skeleton.num_real) if skeleton.lo[i] > 0]
        lengths[multi[0]] = int(skeleton.lo[multi[0]])
    md.decode.seq_lens[:4].copy_(torch.from_numpy(lengths).to(md.decode.seq_lens.dtype))
    ws_before, rows_before = ws.clone(), builder._row_seq_lens_buf.clone()
    assert not builder.advance_graph_step(md, lengths)
    assert torch.equal(builder._row_seq_lens_buf, rows_before)
    if why != "a later build":
        assert torch.equal(ws, ws_before)
