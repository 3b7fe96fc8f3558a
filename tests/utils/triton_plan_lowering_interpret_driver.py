"""Runs the one-launch plan lowering (plan_lowering.py) on CPU tensors under TRITON_INTERPRET=1:
on random refreshable FlashInfer MLA plans (the plan model of flashinfer_mla_plan_model.py) made
for upper-bound lengths, the kernel leaves the int workspace byte for byte as the host refresh
(PlanRefresher.try_refresh) does for the exact lengths, and as the torch path does, and writes
kv_len_arr[:num_reqs] and nothing past it (launched by test_mla_plan_lowering.py)."""
import os
import random

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.flashinfer_mla_plan_model import model_plan  # noqa: E402
from vllm.v1.attention.backends.mla import plan_lowering  # noqa: E402
from vllm.v1.attention.backends.mla.flashinfer_plan_refresh import (  # noqa: E402
    PlanRefresher, PlanSkeleton)


def _pages(kv, page=16):
    return np.concatenate([[0], np.cumsum(-(-np.asarray(kv) // page))]).astype(np.int32)


def main() -> None:
    if not plan_lowering.HAS_TRITON:
        print("NO_TRITON")
        return
    checked = 0
    for seed in range(60):
        rng = random.Random(seed)
        k = rng.choice([1, 3, 4, 7])
        num_real, num_pad = rng.randint(1, 12), rng.randint(0, 3)
        q = k + 1
        qo = np.concatenate([[0], np.cumsum([q] * num_real + [0] * num_pad)]).astype(np.int32)
        upper = np.array([rng.randint(k + 2, rng.choice([60, 700, 3000]))
                          for _ in range(num_real)] + [0] * num_pad, dtype=np.int32)
        pages = _pages(upper)
        heads = 16 if q * 16 <= 64 else 8  # every request one query tile: refreshable
        info, scratch, _ = model_plan(qo, upper, pages, heads, rng.choice([8, 132]))
        skeleton = PlanSkeleton.from_plan(info, scratch, qo, upper, heads, causal=False)
        assert skeleton is not None, seed
        lower = upper.copy()
        lower[:num_real] -= k
        if not skeleton.fits(qo, lower):
            continue  # the early path refreshes on the host then
        exact = upper.copy()
        exact[:num_real] -= np.array([rng.randint(0, k) for _ in range(num_real)], dtype=np.int32)
        host_ws, torch_ws, triton_ws = scratch.clone(), scratch.clone(), scratch.clone()
        on_host = PlanRefresher(host_ws, max_works=256)
        by_torch, by_triton = PlanRefresher(torch_ws, 256), PlanRefresher(triton_ws, 256)
        for refresher in (on_host, by_torch, by_triton):
            refresher.adopt(skeleton)
        assert on_host.try_refresh(qo, pages, exact)
        lens_dtype = rng.choice([torch.int32, torch.int64])
        lens = torch.from_numpy(exact[:num_real]).to(lens_dtype)
        arr_torch = torch.full((num_real + 4,), -7, dtype=torch.int32)
        arr_triton = arr_torch.clone()
        by_torch.lower_on_device(lens, num_real, arr_torch)  # CPU tensors: the torch path
        index, n, m = by_triton._index_on_device()
        plan_lowering.lower_plan_triton(by_triton.device_ws, index, lens, arr_triton, n, m,
                                        num_real)
        assert torch.equal(torch_ws, host_ws), seed
        assert torch.equal(triton_ws, host_ws), seed
        assert torch.equal(arr_triton[:num_real], torch.from_numpy(exact[:num_real])), seed
        assert (arr_triton[num_real:] == -7).all() and torch.equal(arr_triton, arr_torch), seed
        checked += 1
    assert checked >= 30, checked  # most random plans admit the lowering
    rebuilt = _check_csr_rebuild()
    print("TRITON_INTERPRET_OK", checked, rebuilt)


def _check_csr_rebuild() -> int:
    """The page lists rebuilt on the device (rebuild_csr_*), then the lengths lowered: for a
    plan held from an earlier step whose requests grew into pages it does not list (and whose
    rows' page ids changed), the work arrays equal a host refresh for the new lengths and page
    lists, and the CSR equals what a host plan lists (cumulative page counts; each request's
    first pages of its block-table row). With a lookahead (every other plan) each request lists
    the pages of its length plus the lookahead, and the padding requests still list none."""
    page, checked, ahead_checked = 16, 0, 0
    for seed in range(100, 160):
        rng = random.Random(seed)
        k = rng.choice([0, 1, 4, 7])  # 0: plain Q=1 rows
        num_real, num_pad = rng.randint(1, 12), rng.randint(0, 3)
        q = k + 1
        qo = np.concatenate([[0], np.cumsum([q] * num_real + [0] * num_pad)]).astype(np.int32)
        planned = np.array([rng.randint(k + 2, rng.choice([60, 700, 3000]))
                            for _ in range(num_real)] + [0] * num_pad, dtype=np.int32)
        heads = 16 if q * 16 <= 64 else 8
        info, scratch, _ = model_plan(qo, planned, _pages(planned), heads, rng.choice([8, 132]))
        skeleton = PlanSkeleton.from_plan(info, scratch, qo, planned, heads, causal=k > 0)
        assert skeleton is not None, seed
        exact = planned.copy()
        exact[:num_real] += np.array([rng.randint(0, 2 * page) for _ in range(num_real)],
                                     dtype=np.int32)
        if not skeleton.fits(qo, exact):
            continue
        lookahead = rng.choice([0, rng.randint(1, 3 * page)])
        width = int(-(-(exact.max() + lookahead) // page)) + rng.randint(0, 3)
        table = torch.from_numpy(np.array(rng.sample(range(1, 100000), (num_real + 2) * width),
                                          dtype=np.int32).reshape(num_real + 2, width))
        listed = exact.copy()
        listed[:num_real] += lookahead  # the lengths whose pages are listed
        new_indptr = _pages(listed)
        expected_indices = np.concatenate([table[r, :new_indptr[r + 1] - new_indptr[r]].numpy()
                                           for r in range(num_real)])
        host_ws = scratch.clone()
        on_host = PlanRefresher(host_ws, max_works=256)
        on_host.adopt(skeleton)
        assert on_host.try_refresh(qo, new_indptr, exact)
        lens = torch.from_numpy(exact[:num_real])
        planned_reqs = num_real + num_pad
        work_req = torch.from_numpy(skeleton.work_req)
        pos = skeleton.offsets["kv_indptr"]
        for rebuild in (plan_lowering.rebuild_csr_torch, plan_lowering.rebuild_csr_triton):
            ws = scratch.clone()
            refresher = PlanRefresher(ws, 256)
            refresher.adopt(skeleton)
            kv_indptr = torch.full((planned_reqs + 1,), -5, dtype=torch.int32)
            kv_indices = torch.full((int(new_indptr[-1]) + 7,), -5, dtype=torch.int32)
            rebuild(table, lens, num_real, planned_reqs, kv_indptr, kv_indices,
                    refresher.device_ws, pos, work_req, page, lookahead=lookahead)
            refresher.lower_on_device(lens, num_real, None)
            assert torch.equal(refresher.device_ws, on_host.device_ws), (seed, rebuild.__name__)
            assert kv_indptr.tolist() == new_indptr.tolist(), (seed, rebuild.__name__)
            total = int(new_indptr[-1])
            assert kv_indices[:total].tolist() == expected_indices.tolist(), seed
            assert (kv_indices[total:] == -5).all(), seed
        checked += 1
        ahead_checked += lookahead > 0
    assert checked >= 20 and ahead_checked >= 5, (checked, ahead_checked)
    return checked


if __name__ == "__main__":
    main()
