"""Triton kernels for block-FP8 linear layers (weights float8_e4m3fn with one float32 scale per
(bn x bk) block, DeepSeek-V3 format; Hopper and newer).

Two GEMM families, picked per call by `select_config` from the token count M (on a GPU with
tuned tables: whichever the tuner measured faster for that shape and M; see configs/README.md):

* W8A16, small M (decode): `w8a16_block_fp8_matmul(x, w, w_scale, block)`. The activation stays in
  the model dtype (no quantisation pass); each program streams a (BLOCK_N x BLOCK_K) fp8 weight
  tile, casts it to the activation dtype in registers (exact: every e4m3 value is a bf16/fp16
  value) and accumulates in float32, multiplying each K chunk's partial by its block scale. Two
  kernels: `dot` computes (W_tile x^T) on tensor cores with the weight as the wide operand (the
  "swap AB" trick: N fills the MMA's 64-row side, the M <= 16 tokens its narrow side, so no
  weight bytes are wasted, only MMA columns, which are free in a bandwidth-bound GEMM), `gemv`
  multiply-adds on CUDA cores into a (BLOCK_M, BLOCK_N, BLOCK_K) accumulator reduced once at the
  end (no tensor-core tile at all, no per-chunk cross-thread reduction). Why W8A16 for decode: at
  M <= 64 the GEMM only streams weight bytes, so its cost is the fp8 weight read (half of bf16)
  plus fixed per-kernel costs; W8A16 needs no activation quantisation kernel and no fp8 MMA, and
  the cast of the weight tile hides under the memory stream. Numerics: y = x . dequant(W) with fp32
  accumulation, i.e. only the weight is quantised; this is MORE accurate than W8A8, which also
  rounds every activation to e4m3 (3 mantissa bits, ~2^-4 relative error per element).
* W8A8, larger M (prefill): `per_token_group_quant_fp8(x, group)` quantises x per (token, 128)
  (scale = amax / 448), then `w8a8_block_fp8_matmul` runs fp8 tl.dot tiles, scaling each K chunk's
  product by a_scale[m, kb] * w_scale[n // bn, kb] before it is added (fp8 tensor cores: twice the
  bf16 MMA rate where the GEMM is compute-bound).

Split-K: with SPLIT_K > 1 each split writes float32 partials [split, M, N]; the last split of a
tile to finish (an atomic ticket per output tile) adds them in split order, adds the bias and
casts. Why in the GEMM kernel: a decode GEMM takes 5-20 us, and a separate reduce kernel costs
one more launch and ramp (~2 us, 11 % of the fp8 decode step's kernel time on the V3-rank config
before this was done). Deterministic all the same: the sum always runs 0, 1, ..., split-1, only
WHICH program runs it varies. The tickets live in a persistent zeroed int32 buffer per
device and the reducer sets its ticket back to 0, so the buffer stays zero between
launches (also across CUDA-graph replays); the engine's GEMMs run one after another on one
stream and share it. Grids with more tiles than tickets fall back to the separate reduce kernel
(`_splitk_reduce_kernel`). Without a split the GEMM kernel itself adds the bias and writes the
output dtype.

Launch configurations come from tuned JSON tables (fp8_gemm_configs.py, written by
benchmarks/kernels/tune_fp8_gemm.py) for the current device when present, else from the shape
heuristics `_plan` / `_plan_w8a16`. No autotuning at run time: every launch is a fixed function
of (M, N, K, device), so CUDA-graph capture sees no tuning runs, no host syncs, and allocations
that depend only on shapes.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from vllm.model_executor.layers.quantization.fp8_gemm_configs import (W8A8_TAG, W8A16_TAG, GemmConfig,
                                                                      find_table, nearest_config)
from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path never needs these
    triton = None
    tl = None

_MIN_SCALE = 1e-12
# Without a tuned table, M up to this many tokens takes the W8A16 kernel (decode batches).
SMALL_M_MAX = 16
_W8A16_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

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
    def _store_tile(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, bias_ptr, lock_ptr, split,
                    IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SERIAL: tl.constexpr):
        # acc [BLOCK_M, BLOCK_N] float32: a split's partial, or the finished tile
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if IS_SPLIT:
            tile_offs = offs_m[:, None] * N + offs_n[None, :]
            tl.store(part_ptr + split * M * N + tile_offs, acc, mask=mask)
            if SERIAL:
                # Every thread's partial store is issued before the ticket (bar.sync), and the
                # ticket is a release/acquire at GPU scope: the program that draws the last
                # ticket sees every split's partial.
                num_splits = tl.num_programs(1)
                tl.debug_barrier()
                ticket = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
                if ticket == num_splits - 1:
                    total = tl.zeros_like(acc)
                    for s in range(num_splits):
                        # .cg: read through L2, never an L1 line left by an earlier launch
                        total += tl.load(part_ptr + s * M * N + tile_offs, mask=mask, other=0.0,
                                         cache_modifier=".cg")
                    if HAS_BIAS:
                        total += tl.load(bias_ptr + offs_n, mask=offs_n < N,
                                         other=0.0).to(tl.float32)[None, :]
                    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                             total.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(lock_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)

    # M, the split count and K chunks per split are not specialised on (==1, %16): they change with
    # the batch and the config, and a recompile per value would only cost compile time.
    @triton.jit(do_not_specialize=["M", "split"])
    def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, split,
                              BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
        # fixed order 0, 1, ..., split-1: deterministic float32 sums
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in range(1, split):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        m = offs // N
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M", "chunks_per_split"])
    def _w8a8_dot_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                         stride_am, stride_wn, stride_om, num_a_groups, num_ws_k, chunks_per_split,
                         GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SERIAL: tl.constexpr):
        # program (tile, split); tiles in groups of GROUP_M row tiles that walk the column tiles
        # together (they share weight tiles in L2)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % group_rows
        pid_n = (pid % width) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        ws_rows = (offs_n // GROUP_N) * num_ws_k
        c_start = split * chunks_per_split
        c_end = tl.minimum(c_start + chunks_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c in range(c_start, c_end):
            k = c * BLOCK_K + offs_k
            mask_k = k < K
            g = (c * BLOCK_K) // GROUP_K  # BLOCK_K divides GROUP_K: one scale per chunk
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            a_s = tl.load(as_ptr + offs_m * num_a_groups + g, mask=mask_m, other=0.0)
            w_s = tl.load(ws_ptr + ws_rows + g, mask=mask_n, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        _store_tile(acc, offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, bias_ptr, lock_ptr, split,
                    IS_SPLIT, HAS_BIAS, SERIAL)

    @triton.jit(do_not_specialize=["M", "chunks_per_split"])
    def _w8a16_dot_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                          stride_xm, stride_wn, stride_om, num_ws_k, chunks_per_split,
                          GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SERIAL: tl.constexpr, FP32_IEEE: tl.constexpr):
        # acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] . x_tile^T [BLOCK_K, BLOCK_M]:
        # weight rows on the MMA's wide side. Row tiles are the fastest program index, so the
        # programs sharing a weight tile (M > BLOCK_M) run side by side and hit L2.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        ws_rows = (offs_n // GROUP_N) * num_ws_k
        c_start = split * chunks_per_split
        c_end = tl.minimum(c_start + chunks_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for c in range(c_start, c_end):
            k = c * BLOCK_K + offs_k
            mask_k = k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None],
                         mask=mask_k[:, None] & mask_m[None, :], other=0.0)
            w_s = tl.load(ws_ptr + ws_rows + (c * BLOCK_K) // GROUP_K, mask=mask_n, other=0.0)
            if FP32_IEEE:  # float32 activations: full-precision dot, not tf32
                part = tl.dot(w.to(tl.float32), xt, input_precision="ieee")
            else:
                part = tl.dot(w.to(xt.dtype), xt)  # e4m3 -> bf16/fp16 is exact
            acc += part * w_s[:, None]
        _store_tile(tl.trans(acc), offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, bias_ptr,
                    lock_ptr, split, IS_SPLIT, HAS_BIAS, SERIAL)

    @triton.jit(do_not_specialize=["M", "chunks_per_split"])
    def _w8a16_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                           stride_xm, stride_wn, stride_om, num_ws_k, chunks_per_split,
                           GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_SPLIT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, SERIAL: tl.constexpr, NUM_STAGES: tl.constexpr):
        # CUDA-core weight streaming: acc[m, n, k] += x[m, k] * w[n, k] * scale over the K chunks,
        # one reduction over k after the loop (the scale is folded in per chunk, so the deferred
        # sum is exact in meaning)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        ws_rows = (offs_n // GROUP_N) * num_ws_k
        c_start = split * chunks_per_split
        c_end = tl.minimum(c_start + chunks_per_split, tl.cdiv(K, BLOCK_K))
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        # The loop is pipelined explicitly (cp.async into shared memory, NUM_STAGES deep): Triton's
        # default pipeliner only prefetches loads that feed a tl.dot. NUM_STAGES 1 = plain register
        # loads, latency hidden by occupancy alone; the tuner sweeps both.
        for c in tl.range(c_start, c_end, num_stages=NUM_STAGES):
            k = c * BLOCK_K + offs_k
            mask_k = k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            w_s = tl.load(ws_ptr + ws_rows + (c * BLOCK_K) // GROUP_K, mask=mask_n, other=0.0)
            acc += x[:, None, :] * (w * w_s[:, None])[None, :, :]
        _store_tile(tl.sum(acc, axis=2), offs_m, offs_n, M, N, out_ptr, stride_om, part_ptr, bias_ptr,
                    lock_ptr, split, IS_SPLIT, HAS_BIAS, SERIAL)


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
_DEVICE_NAMES: dict[int, str] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs on CPU: plan as for an H100/H200
    index = _device_index(device)
    if index not in _NUM_SMS:  # a host-side property query, once per device (no sync)
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _device_name(device: torch.device) -> str | None:
    """torch.cuda.get_device_name (host-side, cached); None on CPU (interpreter): no tuned tables."""
    if device.type != "cuda":
        return None
    index = _device_index(device)
    if index not in _DEVICE_NAMES:
        _DEVICE_NAMES[index] = torch.cuda.get_device_name(index)
    return _DEVICE_NAMES[index]


def _split_for(tiles: int, k_blocks: int, num_sms: int) -> int:
    """Split K until the programs cover every SM about twice (decode GEMMs of narrow weights have
    too few output tiles to keep the GPU streaming), keeping >= 2 K blocks per split."""
    target = 2 * num_sms
    if tiles >= target or k_blocks < 4:
        return 1
    return max(1, min(-(-target // tiles), k_blocks // 2, 16))


def _plan(m: int, n: int, k: int, block: tuple[int, int], device: torch.device) -> tuple[int, int, int]:
    """W8A8 heuristic (no tuned table): (BLOCK_M, BLOCK_N, split_k). Decode batches (small M) are
    bandwidth-bound: narrow column tiles, and split-K when the tiles alone cannot keep every SM
    streaming weight (kv_a_proj has 576 rows = 9 tiles of 64). tl.dot needs tiles of at least 16."""
    return _plan_sms(m, n, k, block, _num_sms(device))


def _plan_sms(m: int, n: int, k: int, block: tuple[int, int], num_sms: int) -> tuple[int, int, int]:
    bn, bk = block
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = min(64 if m <= 32 else 128, bn)
    tiles = -(-m // block_m) * -(-n // block_n)
    split = _split_for(tiles, -(-k // bk), num_sms) if m <= 64 else 1  # larger M: compute-bound
    return block_m, block_n, split


def _plan_w8a16(m: int, n: int, k: int, block: tuple[int, int], num_sms: int) -> GemmConfig:
    """W8A16 heuristic (no tuned table): tensor-core kernel, 64 weight rows per program, split-K
    as in `_plan`."""
    block_m = max(16, 1 << max(0, m - 1).bit_length()) if m <= 64 else 64
    block_k = min(128, block[1])
    tiles = -(-m // block_m) * -(-n // 64)
    return GemmConfig("w8a16_dot", block_m=block_m, block_n=64, block_k=block_k, num_warps=4,
                      num_stages=4, split_k=_split_for(tiles, -(-k // block_k), num_sms))


@functools.lru_cache(maxsize=4096)
def w8a8_config(m: int, n: int, k: int, block: tuple[int, int], device_name: str | None, num_sms: int,
                config_dir: str | None = None) -> GemmConfig:
    """The W8A8 launch for M tokens: the fp8_w8a8 table entry nearest to M, else `_plan`."""
    table = find_table(n, k, device_name, W8A8_TAG, block, config_dir) if device_name else None
    cfg = nearest_config(table, m) if table else None
    if cfg is not None:
        return cfg
    block_m, block_n, split = _plan_sms(m, n, k, block, num_sms)
    return GemmConfig("w8a8_dot", block_m=block_m, block_n=block_n, block_k=block[1], num_warps=4,
                      num_stages=3, split_k=split)


@functools.lru_cache(maxsize=4096)
def w8a16_config(m: int, n: int, k: int, block: tuple[int, int], device_name: str | None, num_sms: int,
                 config_dir: str | None = None) -> GemmConfig:
    """The W8A16 launch for M tokens: the fp8_w8a16 table entry nearest to M, else `_plan_w8a16`."""
    table = find_table(n, k, device_name, W8A16_TAG, block, config_dir) if device_name else None
    cfg = nearest_config(table, m) if table else None
    return cfg if cfg is not None else _plan_w8a16(m, n, k, block, num_sms)


@functools.lru_cache(maxsize=4096)
def select_config(m: int, n: int, k: int, block: tuple[int, int], device_name: str | None,
                  dtype: torch.dtype, num_sms: int, config_dir: str | None = None) -> GemmConfig:
    """The launch for M tokens of an [N, K] weight: W8A16 when M is at most the largest M of the
    shape's fp8_w8a16 table, else W8A8. The tuner writes that table only over the Ms where W8A16
    measured at least as fast as W8A8, so a tuned shape with a W8A8 table and no W8A16 table
    runs W8A8 at every M; an untuned shape takes W8A16 up to SMALL_M_MAX. Host-only and cached:
    safe inside CUDA-graph capture."""
    block = tuple(block)
    small = find_table(n, k, device_name, W8A16_TAG, block, config_dir) if device_name else None
    if small:
        limit = max(small)
    elif device_name and find_table(n, k, device_name, W8A8_TAG, block, config_dir):
        limit = 0  # tuned, and W8A8 won already at the smallest M
    else:
        limit = SMALL_M_MAX
    if dtype in _W8A16_DTYPES and m <= limit:
        return w8a16_config(m, n, k, block, device_name, num_sms, config_dir)
    return w8a8_config(m, n, k, block, device_name, num_sms, config_dir)


def _check_block(block: tuple[int, int], fn: str) -> None:
    bn, bk = block
    if bk & (bk - 1) or bn & (bn - 1) or bk < 16 or bn < 16:
        raise ValueError(f"{fn}: weight_block_size {list(block)} must be powers of two >= 16 for the "
                         "Triton block-FP8 GEMM")


def _split_plan(k: int, cfg: GemmConfig) -> tuple[int, int]:
    """(K chunks per split, splits): the requested split clamped to the chunk count, with no empty
    trailing split."""
    chunks = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, chunks))
    per = triton.cdiv(chunks, split)
    return per, triton.cdiv(chunks, per)


def _outputs(m: int, n: int, split: int, out_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=device) if split > 1 else out
    return out, part


# Split-K tickets: one int32 per output tile, kept at zero between launches (see the module
# docstring); grids with more tiles take the separate reduce kernel.
SPLIT_TICKETS = 4096
_TICKETS: dict[tuple, torch.Tensor] = {}


def _split_tickets(device: torch.device) -> torch.Tensor:
    """The zeroed ticket buffer of `device`. One per device, not per stream: CUDA-graph capture
    runs on a side stream of its own and must see the buffer the eager warm-up made. Sharing is
    safe because the engine launches its GEMMs on one stream at a time (no side-stream GEMMs);
    two fp8 GEMMs running concurrently on two streams would have to get separate buffers."""
    key = (device.type, _device_index(device) if device.type == "cuda" else 0)
    tickets = _TICKETS.get(key)
    if tickets is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made during capture it would live in the graph's pool and be zeroed by a captured
            # memset; every layer runs eagerly (warm-up) before any capture, so this means a bug.
            raise RuntimeError("fp8 split-K tickets first requested during CUDA-graph capture; run "
                               "the GEMM once eagerly before capturing it")
        tickets = torch.zeros(SPLIT_TICKETS, dtype=torch.int32, device=device)
        _TICKETS[key] = tickets
    return tickets


def _serial_reduce(num_tiles: int, split: int, serial: bool | None) -> bool:
    """Reduce the splits inside the GEMM kernel (the default) unless the grid has more tiles than
    tickets; `serial` False forces the separate reduce kernel (tests compare the two)."""
    if split <= 1:
        return False
    if serial is None:
        serial = True
    return serial and num_tiles <= SPLIT_TICKETS


def _reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split: int) -> None:
    m, n = out.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else out, out, m, n, out.stride(0), split, BLOCK=block,
        HAS_BIAS=bias is not None)


def _check_operands(fn: str, k: int, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: tuple[int, int], bias: torch.Tensor | None) -> None:
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"{fn}: activation K={k} != weight K={k_w}")
    want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(weight_scale.shape) != want or not weight_scale.is_contiguous():
        raise ValueError(f"{fn}: weight_scale shape {tuple(weight_scale.shape)} must be a contiguous "
                         f"{want} for weight {(n, k)} and block {list(block)}")
    if weight.stride(1) != 1:
        raise ValueError(f"{fn}: weight must be row-major (stride {weight.stride()})")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{fn}: bias shape {tuple(bias.shape)} must be a contiguous ({n},)")


def w8a8_block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor, block: tuple[int, int],
                          out_dtype: torch.dtype, split_k: int | None = None,
                          bias: torch.Tensor | None = None,
                          config: GemmConfig | None = None,
                          serial_reduce: bool | None = None) -> torch.Tensor:
    """a [M, K] fp8, a_scale [M, ceil(K/bk)], weight [N, K] fp8, weight_scale [ceil(N/bn),
    ceil(K/bk)] -> [M, N] in out_dtype (+ bias). `config` None = the tuned table / heuristic for
    these shapes; `split_k` overrides its split. With a split the float32 partial sums of the K
    ranges are added in a fixed order (deterministic), by the tile's last split (`serial_reduce`
    None/True) or by a separate reduce kernel (False)."""
    _need_triton()
    block = tuple(block)
    _check_block(block, "w8a8_block_fp8_matmul")
    m, k = a.shape
    n = weight.shape[0]
    _check_operands("w8a8_block_fp8_matmul", k, weight, weight_scale, block, bias)
    groups = triton.cdiv(k, block[1])
    if a.stride(1) != 1 or tuple(a_scale.shape) != (m, groups) or not a_scale.is_contiguous():
        raise ValueError(f"w8a8_block_fp8_matmul: a (strides {a.stride()}) must have unit column stride "
                         f"and a_scale (shape {tuple(a_scale.shape)}) be a contiguous {(m, groups)}: one "
                         f"scale per token and {block[1]} columns (per_token_group_quant_fp8)")
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=a.device)
    if config is None:
        config = w8a8_config(m, n, k, block, _device_name(a.device), _num_sms(a.device))
    if config.kernel != "w8a8_dot":
        raise ValueError(f"w8a8_block_fp8_matmul: config kernel {config.kernel!r} is not w8a8_dot")
    if split_k is not None:
        config = dataclasses.replace(config, split_k=max(1, int(split_k)))
    config.check(block)
    per, split = _split_plan(k, config)
    out, part = _outputs(m, n, split, out_dtype, a.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    serial = _serial_reduce(tiles, split, serial_reduce)
    tickets = _split_tickets(a.device) if serial else out
    _w8a8_dot_kernel[(tiles, split)](
        a, a_scale, weight, weight_scale, bias if bias is not None else out, out, part, tickets, m, n, k,
        a.stride(0), weight.stride(0), out.stride(0), a_scale.shape[1], weight_scale.shape[1], per,
        GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, IS_SPLIT=split > 1, HAS_BIAS=bias is not None,
        SERIAL=serial, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1 and not serial:
        _reduce_splits(part, bias, out, split)
    return out


def w8a16_block_fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           block: tuple[int, int], bias: torch.Tensor | None = None,
                           config: GemmConfig | None = None,
                           serial_reduce: bool | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32 (row stride free, unit column stride), weight [N, K] fp8,
    weight_scale [ceil(N/bn), ceil(K/bk)] -> x . dequant(weight)^T (+ bias) [M, N] in x.dtype,
    float32 accumulation; the activation is not quantised (see the module docstring).
    `config` None = the tuned table / heuristic for these shapes; `serial_reduce` as in
    `w8a8_block_fp8_matmul`."""
    _need_triton()
    block = tuple(block)
    _check_block(block, "w8a16_block_fp8_matmul")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"w8a16_block_fp8_matmul: x must be 2-D with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in _W8A16_DTYPES:
        raise ValueError(f"w8a16_block_fp8_matmul: activation dtype {x.dtype} is not one of "
                         f"{list(_W8A16_DTYPES)}")
    m, k = x.shape
    n = weight.shape[0]
    _check_operands("w8a16_block_fp8_matmul", k, weight, weight_scale, block, bias)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if config is None:
        config = w8a16_config(m, n, k, block, _device_name(x.device), _num_sms(x.device))
    if config.kernel not in ("w8a16_dot", "w8a16_gemv"):
        raise ValueError(f"w8a16_block_fp8_matmul: config kernel {config.kernel!r} is not a W8A16 kernel")
    config.check(block)
    per, split = _split_plan(k, config)
    out, part = _outputs(m, n, split, x.dtype, x.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    serial = _serial_reduce(tiles, split, serial_reduce)
    grid = (tiles, split)
    args = (x, weight, weight_scale, bias if bias is not None else out, out, part,
            _split_tickets(x.device) if serial else out, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0), weight_scale.shape[1], per)
    meta = dict(GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                BLOCK_K=config.block_k, IS_SPLIT=split > 1, HAS_BIAS=bias is not None, SERIAL=serial,
                num_warps=config.num_warps, num_stages=config.num_stages)
    if config.kernel == "w8a16_dot":
        _w8a16_dot_kernel[grid](*args, FP32_IEEE=x.dtype == torch.float32, **meta)
    else:
        _w8a16_gemv_kernel[grid](*args, NUM_STAGES=config.num_stages, **meta)
    if split > 1 and not serial:
        _reduce_splits(part, bias, out, split)
    return out


def apply_w8a8_block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for x [..., K] in bf16/fp16/fp32, the one entry point of fp8 layers:
    W8A16 weight streaming for small token counts (decode), else quantise x per (token, bk) and
    run the W8A8 GEMM. The bias is added inside the kernels."""
    _need_triton()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = tuple(block)
    m, k = x2.shape
    n = weight.shape[0]
    cfg = select_config(m, n, k, block, _device_name(x2.device), x2.dtype, _num_sms(x2.device))
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if cfg.kernel == "w8a8_dot":
        q, s = per_token_group_quant_fp8(x2, block[1])
        y = w8a8_block_fp8_matmul(q, s, weight, weight_scale, block, x.dtype, bias=bias, config=cfg)
    else:
        y = w8a16_block_fp8_matmul(x2, weight, weight_scale, block, bias=bias, config=cfg)
    return y.view(*shape[:-1], n)
