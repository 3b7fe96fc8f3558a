from pathlib import Path

import pytest

from tests.utils.triton_interpreter import run_interpreter_driver

_DRIVER = Path(__file__).parents[1].joinpath("utils", "triton_fp8_interpret_driver.py")


@pytest.mark.slow
def test_fp8_w8a8_kernels_equal_references_under_interpreter():
    """The W8A8 block-FP8 GEMM (partial blocks, M from 1 to 70, blocks 128x128 and 64x64, split-K,
    grouped tile order, bias) equals a float64 oracle, and the per-token-group activation
    quantisation equals the torch reference, executed by Triton's CPU interpreter."""
    run_interpreter_driver(_DRIVER, ("w8a8",))


@pytest.mark.slow
def test_fp8_w8a16_kernels_equal_float64_reference_under_interpreter():
    """Both W8A16 kernels (tensor-core and CUDA-core) equal float64 x . dequant(W)^T (+ bias) for
    M in {1, 3, 16, 17}, K = 300 (partial scale block), N = 200 (partial tiles), split-K 1-4."""
    run_interpreter_driver(_DRIVER, ("w8a16",))


@pytest.mark.slow
def test_fp8_linear_entry_point_dispatches_by_batch_size_under_interpreter():
    """apply_w8a8_block_fp8_linear: W8A16 numerics for a decode-sized batch, W8A8 above it."""
    run_interpreter_driver(_DRIVER, ("linear",))


@pytest.mark.slow
def test_fp8_split_k_reduced_in_kernel_equals_reduce_kernel_under_interpreter():
    """Split-K reduced by each tile's last split (atomic tickets) gives the reduce kernel's bits
    for W8A8, W8A16 tensor-core and CUDA-core kernels; tickets return to zero; grids with more
    tiles than tickets fall back to the reduce kernel."""
    run_interpreter_driver(_DRIVER, ("split",))
