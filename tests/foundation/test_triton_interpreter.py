import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("triton_interpret_driver.py")


@pytest.mark.slow
def test_triton_kernels_equal_torch_under_interpreter():
    """The Triton kernels' logic, executed by Triton's CPU interpreter, equals the torch paths.
    (Compilation for the GPU is covered by the `gpu` tests.)"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(DRIVER)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "NO_TRITON" in proc.stdout:
        pytest.skip("triton is not importable here")
    assert "TRITON_INTERPRET_OK" in proc.stdout
