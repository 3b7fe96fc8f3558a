"""The one-launch Triton row geometry equals the builder's torch path (Triton interpreter, CPU)."""
from pathlib import Path

from tests.utils.triton_interpreter import run_interpreter_driver


def test_triton_row_seq_lens_equals_torch_path():
    run_interpreter_driver(Path(__file__).resolve().parents[2] / "utils"
                           / "triton_row_seq_lens_interpret_driver.py")
