from pathlib import Path

import pytest

from tests.utils.triton_interpreter import run_interpreter_driver


@pytest.mark.slow
def test_triton_merge_kernel_equals_torch_under_interpreter():
    """The fused merge kernel's logic, run by Triton's CPU interpreter, equals the torch path
    (NaN/inf LSEs, all-empty rows, both LSE bases). GPU compilation: tests/attention/*_gpu.py."""
    run_interpreter_driver(Path(__file__).parents[2].joinpath("utils", "triton_merge_interpret_driver.py"))
