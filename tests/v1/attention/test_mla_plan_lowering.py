"""The one-launch Triton plan lowering equals the host refresh and the torch path (Triton
interpreter, CPU)."""
from pathlib import Path

from tests.utils.triton_interpreter import run_interpreter_driver


def test_triton_plan_lowering_writes_what_a_host_refresh_writes():
    run_interpreter_driver(Path(__file__).resolve().parents[2] / "utils"
                           / "triton_plan_lowering_interpret_driver.py")
