"""Lower a held FlashInfer MLA plan to lengths only the device knows yet, in one launch.

What it writes (PlanRefresher.lower_on_device; flashinfer_plan_refresh.py says what a plan's
work arrays are): for a plan made from host upper bounds, with the exact lengths `lens[r]` of
its requests on the device,
  ws[len_pos[i]] = lens[len_req[i]]   every real work's kv_len,
  ws[end_pos[j]] = lens[end_req[j]]   every request-ending work's kv_end,
  kv_len_arr[r]  = lens[r]            the wrapper's per-request lengths (r < num_reqs),
where `index` is the flat int64 [len_pos, len_req, end_pos, end_req] of the held skeleton.

Why one kernel: the torch form is five launches (two index_select, two index_copy_, a copy),
each ~10-15 us of host time on the H100 node. Measured there (twenty-third session, runs on
one H100, `probe_spec_step.py` with the early draft launch on and off in one host): the launch
before the wait took ~0.16 ms of host work out of a B=1 DSpark step's proposal, and the device
lowering's launches put about as much back, so the step did not get shorter. The torch form
stays as the reference and the CPU path.
"""
from __future__ import annotations

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.utils.triton_launch import LeanLaunch

_BLOCK = 128

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_len", "num_end", "num_reqs"])
    def _lower_plan_kernel(ws_ptr, index_ptr, lens_ptr, kv_len_arr_ptr, num_len, num_end,
                           num_reqs, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        # every real work's kv_len (the first 2 * num_len entries of the index)
        on = i < num_len
        pos = tl.load(index_ptr + i, mask=on, other=0)
        req = tl.load(index_ptr + num_len + i, mask=on, other=0)
        tl.store(ws_ptr + pos, tl.load(lens_ptr + req, mask=on, other=0).to(tl.int32), mask=on)
        # the kv_end of every work that ends its request's KV (the next 2 * num_end)
        on = i < num_end
        base = 2 * num_len
        pos = tl.load(index_ptr + base + i, mask=on, other=0)
        req = tl.load(index_ptr + base + num_end + i, mask=on, other=0)
        tl.store(ws_ptr + pos, tl.load(lens_ptr + req, mask=on, other=0).to(tl.int32), mask=on)
        # the wrapper's kv_len_arr of the requests
        on = i < num_reqs
        lens = tl.load(lens_ptr + i, mask=on, other=0)
        tl.store(kv_len_arr_ptr + i, lens.to(kv_len_arr_ptr.dtype.element_ty), mask=on)


# Through LeanLaunch (vllm/utils/triton_launch.py; off unless VLLM_LEAN_TRITON_LAUNCH=1).
_LOWER_PLAN_LAUNCH = LeanLaunch(_lower_plan_kernel) if HAS_TRITON else None


def lower_plan_triton(ws: torch.Tensor, index: torch.Tensor, lens: torch.Tensor,
                      kv_len_arr: torch.Tensor, num_len: int, num_end: int,
                      num_reqs: int) -> None:
    """The module's writes in one launch (ws int32, index int64 flat, lens / kv_len_arr any
    integer dtype, all on one CUDA device, or CPU under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("lower_plan_triton needs Triton; use lower_plan_torch")
    rows = max(num_len, num_end, num_reqs)
    if rows <= 0:
        return
    _LOWER_PLAN_LAUNCH((triton.cdiv(rows, _BLOCK),), ws, index, lens, kv_len_arr, num_len,
                       num_end, num_reqs, BLOCK=_BLOCK)


def lower_plan_torch(ws: torch.Tensor, index: torch.Tensor, lens: torch.Tensor,
                     kv_len_arr: torch.Tensor | None, num_len: int, num_end: int,
                     num_reqs: int) -> None:
    """The same writes with torch ops (the reference, and the path off CUDA)."""
    n, m = num_len, num_end
    values = lens[:num_reqs].to(torch.int32)
    ws.index_copy_(0, index[:n], values.index_select(0, index[n:2 * n]))
    ws.index_copy_(0, index[2 * n:2 * n + m],
                   values.index_select(0, index[2 * n + m:2 * n + 2 * m]))
    if kv_len_arr is not None:
        kv_len_arr[:num_reqs].copy_(lens[:num_reqs])
