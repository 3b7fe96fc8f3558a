"""Run a Triton kernel-check driver under Triton's CPU interpreter (TRITON_INTERPRET=1).

The drivers compare a kernel's logic with the torch path and print TRITON_INTERPRET_OK; they run in
a subprocess because the interpreter flag is read when triton is imported. GPU compilation itself is
covered by the `gpu` tests."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreter_driver(driver: Path, args: tuple[str, ...] = ()) -> None:
    """`args` are passed to the driver (e.g. the names of the checks to run)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    # Drivers may import shared test helpers (`tests.utils...`): put this checkout's root first.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(driver), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "NO_TRITON" in proc.stdout:
        pytest.skip("triton is not importable here")
    assert "TRITON_INTERPRET_OK" in proc.stdout
