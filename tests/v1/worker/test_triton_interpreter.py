from pathlib import Path

import pytest

from tests.utils.triton_interpreter import run_interpreter_driver


@pytest.mark.slow
def test_triton_kernels_equal_torch_under_interpreter():
    """The DCP-length and slot-mapping kernels' logic, executed by Triton's CPU interpreter, equals
    the torch paths. (Compilation for the GPU is covered by the `gpu` tests.)"""
    run_interpreter_driver(Path(__file__).parents[2].joinpath("utils", "triton_interpret_driver.py"))
