from pathlib import Path

import pytest

from tests.utils.triton_interpreter import run_interpreter_driver


@pytest.mark.slow
def test_fp8_kernels_equal_references_under_interpreter():
    """The W8A8 block-FP8 GEMM (partial blocks, M from 1 to 70, blocks 128x128 and 64x64) equals a
    float64 oracle, and the per-token-group activation quantisation equals the torch reference,
    executed by Triton's CPU interpreter."""
    run_interpreter_driver(Path(__file__).parents[1].joinpath("utils", "triton_fp8_interpret_driver.py"))
