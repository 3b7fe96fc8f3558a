"""Triton kernels for W8A8 block-FP8 linear layers (Hopper and newer).

* `per_token_group_quant_fp8(x, group)`: x [M, K] -> float8_e4m3fn [M, K] + float32 scales
  [M, ceil(K/group)], one scale per token and 1 x group slice (amax / 448).
* `w8a8_block_fp8_matmul(a, a_scale, w, w_scale, block, out_dtype)`: C = A W^T with A quantised per
  (token, 128-group) and W per (128 x 128) block, accumulated in float32: for every K block the fp8
  tile product is scaled by a_scale[m, kb] * w_scale[n // bn, kb] before it is added.

Launch parameters are plain functions of the shapes (no autotuning, so the first call compiles once
per shape class and CUDA-graph capture sees no tuning runs); small-M calls split K over several
programs (float32 partials summed afterwards) so that decode GEMMs fill the GPU.
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path never needs these
    triton = None
    tl = None

_MIN_SCALE = 1e-12

if triton is not None:

    @triton.jit
    def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm,
                                      fp8_max, min_scale, GROUP: tl.constexpr):
        row = tl.program_id(0)
        group = tl.program_id(1)
        offs = group * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * num_groups + group, scale)

    @triton.jit
    def _w8a8_block_fp8_matmul_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K,
                                      stride_am, stride_wn, stride_cm, stride_cs, num_k_groups, num_ws_k,
                                      k_blocks_per_split,
                                      WEIGHT_BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (tile, split): split s accumulates K blocks [s * per, (s + 1) * per) of its
        # tile and writes them to slice s of c (one slice when there is no split-K)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_n_tiles = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n_tiles
        pid_n = pid % num_n_tiles
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # BLOCK_N divides WEIGHT_BLOCK_N, so one column tile reads a single weight-scale row.
        ws_row = (pid_n * BLOCK_N) // WEIGHT_BLOCK_N
        kb_start = split * k_blocks_per_split
        kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            k = kb * BLOCK_K + offs_k
            mask_k = k < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            a_s = tl.load(as_ptr + offs_m * num_k_groups + kb, mask=mask_m, other=0.0)
            w_s = tl.load(ws_ptr + ws_row * num_ws_k + kb)
            acc += tl.dot(a, w) * a_s[:, None] * w_s
        tl.store(c_ptr + split * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the block-FP8 GEMM needs triton; install it or run the model on CPU "
                           "(reference path: dequantised weights)")


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int = 128,
                              out: torch.Tensor | None = None,
                              scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _need_triton()
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"per_token_group_quant_fp8 expects a row-major 2-D tensor, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device) if out is None else out
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    if m > 0:
        _per_token_group_quant_kernel[(m, groups)](x, q, s, k, groups, x.stride(0), q.stride(0),
                                                   FP8_MAX, _MIN_SCALE, GROUP=group_size)
    return q, s


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs on CPU: plan as for an H100/H200
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:  # a host-side property query, once per device (no sync)
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _plan(m: int, n: int, k: int, block: tuple[int, int], device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, split_k). Decode batches (small M) are bandwidth-bound: narrow column
    tiles, and split-K when the tiles alone cannot keep every SM streaming weight (kv_a_proj has
    576 rows = 9 tiles of 64). tl.dot needs tiles of at least 16."""
    bn, bk = block
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = min(64 if m <= 32 else 128, bn)
    tiles = -(-m // block_m) * -(-n // block_n)
    k_blocks = -(-k // bk)
    target = 2 * _num_sms(device)
    split = 1
    if m <= 64 and tiles < target and k_blocks >= 4:  # larger batches: compute-bound, no split
        split = min(-(-target // tiles), k_blocks // 2, 16)
    return block_m, block_n, max(split, 1)


def w8a8_block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor, block: tuple[int, int],
                          out_dtype: torch.dtype, split_k: int | None = None) -> torch.Tensor:
    """a [M, K] fp8, a_scale [M, ceil(K/bk)], weight [N, K] fp8, weight_scale [ceil(N/bn),
    ceil(K/bk)] -> [M, N] in out_dtype. `split_k` None = chosen from the shapes; with a split the
    float32 partial sums of the K ranges are added in a fixed order (deterministic, no atomics)."""
    _need_triton()
    bn, bk = block
    m, k = a.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"w8a8_block_fp8_matmul: activation K={k} != weight K={k_w}")
    if bk & (bk - 1) or bn & (bn - 1) or bk < 16 or bn < 16:
        raise ValueError(f"weight_block_size {list(block)} must be powers of two >= 16 for the "
                         "Triton block-FP8 GEMM")
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    block_m, block_n, split = _plan(m, n, k, block, a.device)
    k_blocks = triton.cdiv(k, bk)
    if split_k is not None:
        split = max(1, min(int(split_k), k_blocks))
    per = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per)  # no empty trailing split
    if split == 1:
        c = torch.empty((1, m, n), dtype=out_dtype, device=a.device)
    else:
        c = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    _w8a8_block_fp8_matmul_kernel[grid](
        a, a_scale, weight, weight_scale, c, m, n, k, a.stride(0), weight.stride(0), c.stride(1),
        c.stride(0), a_scale.shape[1], weight_scale.shape[1], per, WEIGHT_BLOCK_N=bn, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=bk)
    if split == 1:
        return c[0]
    return c.sum(dim=0).to(out_dtype)


def apply_w8a8_block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for x [..., K] in bf16/fp16/fp32: quantise x per (token, bk), one GEMM."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = per_token_group_quant_fp8(x2, block[1])
    y = w8a8_block_fp8_matmul(q, s, weight, weight_scale, block, x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])
