"""The block-FP8 Triton kernels compile for sm_90 on a machine without a GPU in every variant the
fp8 linear layer launches on an H200: the layer's entry point (`apply_w8a8_block_fp8_linear`) runs
on CPU tensors for every M of every tuned table in configs/ (as if on an NVIDIA H200 with 132
SMs), for prefill Ms past the tables (the shape heuristics) and for an untuned shape, with bf16,
fp16 and float32 activations and with a bias; split-K is also reduced by the separate kernel.
Each distinct launch variant (Triton's own specialization key) compiles once, with its launch
options (num_warps / num_stages), and must fit in sm_90 shared memory. The numerics are checked
by the interpreter and GPU tests."""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

triton = pytest.importorskip("triton")

from vllm.model_executor.layers.quantization import fp8_kernels as fk
from vllm.model_executor.layers.quantization.fp8_gemm_configs import (
    PACKAGE_CONFIG_DIR,
    W8A8_TAG,
    W8A16_TAG,
    load_config_table,
)

_KERNELS = ("_per_token_group_quant_kernel", "_w8a8_dot_kernel", "_w8a16_dot_kernel",
            "_w8a16_gemv_kernel", "_splitk_reduce_kernel")
_BLOCK = (128, 128)
_NAME = re.compile(r"N=(\d+),K=(\d+),device_name=NVIDIA_H200,dtype=(\w+),block_shape=\[128,128\]\.json")


def _tuned_shapes() -> dict[tuple[int, int], set[int]]:
    """{(N, K): the Ms of its H200 tables}."""
    shapes: dict[tuple[int, int], set[int]] = {}
    for path in sorted(PACKAGE_CONFIG_DIR.glob("*.json")):
        match = _NAME.fullmatch(path.name)
        if match:
            n, k, tag = int(match[1]), int(match[2]), match[3]
            assert tag in (W8A8_TAG, W8A16_TAG), path.name
            table = load_config_table(str(path), tag, _BLOCK)
            shapes.setdefault((n, k), set()).update(table)
    return shapes


def _linear(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False) -> None:
    weight = torch.empty(n, k, dtype=fk.FP8_DTYPE)
    scale = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32)
    b = torch.zeros(n, dtype=dtype) if bias else None
    fk.apply_w8a8_block_fp8_linear(torch.empty(m, k, dtype=dtype), weight, scale, _BLOCK, bias=b)


def test_fp8_kernels_compile_for_sm90_at_every_tuned_and_heuristic_config(monkeypatch):
    cuda_target()
    shapes = _tuned_shapes()
    assert len(shapes) >= 6, sorted(shapes)  # the V3 rank shapes are tuned
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(fk, "_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(fk, "_num_sms", lambda device: 132)
    with contextlib.ExitStack() as stack:
        recs = {name: stack.enter_context(record_launches(fk, name)) for name in _KERNELS}
        for (n, k), ms in shapes.items():
            for m in sorted(ms | {4096}):  # past every table: the W8A8 heuristic
                _linear(m, n, k, torch.bfloat16)
        # an untuned shape: the W8A16 heuristic up to SMALL_M_MAX, then W8A8
        for m in (1, 4, 16, 64, 2048):
            _linear(m, 2048, 1024, torch.bfloat16)
        # other activation dtypes and a bias: tuned dot (576 x 7168), tuned gemv (3072 x 1536 at
        # M=2), W8A8 past the tables, and the untuned shape
        for dtype in (torch.float16, torch.float32):
            for m in (1, 16, 256):
                _linear(m, 576, 7168, dtype)
                _linear(m, 2048, 1024, dtype, bias=True)
            _linear(2, 3072, 1536, dtype)
        _linear(4, 576, 7168, torch.bfloat16, bias=True)
        # split-K reduced by the separate kernel (grids with more tiles than tickets)
        x = torch.empty(8, 7168, dtype=torch.bfloat16)
        w = torch.empty(576, 7168, dtype=fk.FP8_DTYPE)
        ws = torch.empty(5, 56, dtype=torch.float32)
        for bias in (None, torch.zeros(576, dtype=torch.bfloat16)):
            fk.w8a16_block_fp8_matmul(x, w, ws, _BLOCK, bias=bias, serial_reduce=False)
            q, s = fk.per_token_group_quant_fp8(x, 128)
            fk.w8a8_block_fp8_matmul(q, s, w, ws, _BLOCK, torch.float32, bias=bias, serial_reduce=False)
    # lower bounds on what the cases must launch: quantisation per activation dtype; W8A8 and the
    # W8A16 dot at least per distinct tuned tile and per dtype; gemv per dtype; reduce +- bias
    least = {"_per_token_group_quant_kernel": 3, "_w8a8_dot_kernel": 7 + 2, "_w8a16_dot_kernel": 5 + 2,
             "_w8a16_gemv_kernel": 3, "_splitk_reduce_kernel": 2}
    for name in _KERNELS:
        compile_recorded(recs[name], expect_at_least=least[name])
