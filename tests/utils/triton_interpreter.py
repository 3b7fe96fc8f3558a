"""Run a Triton kernel-check driver under Triton's CPU interpreter (TRITON_INTERPRET=1).

The drivers compare a kernel's logic with the torch path and print TRITON_INTERPRET_OK; they run in
a subprocess because the interpreter flag is read when triton is imported. GPU compilation itself is
covered by the `gpu` tests.

The drivers listed in BATCHED run together in one subprocess (tests/utils/triton_interpret_batch.py),
started by the first test that asks for any of them; every test still checks its own driver's exit
status and output. Others (e.g. the FP8 driver) get a subprocess each, through the same runner
(so the interpreter corrections of triton_interpreter_fixes.py apply to every driver)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

UTILS = Path(__file__).resolve().parent
ROOT = UTILS.parents[1]
# (driver file in tests/utils, its arguments): independent checks that only read their arguments.
BATCHED = (
    ("triton_merge_interpret_driver.py", ()),
    ("triton_row_seq_lens_interpret_driver.py", ()),
    ("triton_plan_lowering_interpret_driver.py", ()),
    ("triton_interpret_driver.py", ()),
    ("triton_input_batch_interpret_driver.py", ()),
    ("triton_fused_ops_interpret_driver.py", ("kv_cache",)),
    ("triton_fused_ops_interpret_driver.py", ("moe",)),
    ("triton_moe_routing_interpret_driver.py", ()),
    ("triton_markov_greedy_interpret_driver.py", ()),
    ("triton_fused_ops_interpret_driver.py", ("rms_norm", "rope")),
    ("triton_fused_ops_interpret_driver.py", ("context_kv", "context_kv_writer")),
)
_batch_results: dict | None = None


def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    # Drivers may import shared test helpers (`tests.utils...`): put this checkout's root first.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def _run_drivers(drivers: list[tuple[Path, tuple[str, ...]]]) -> dict:
    """Run `drivers` in one interpreter process (triton_interpret_batch.py, which also applies
    triton_interpreter_fixes.py); {(file name, args): (exit status, stdout, stderr)}."""
    specs = [str(path) + ("::" + ",".join(args) if args else "") for path, args in drivers]
    proc = subprocess.run([sys.executable, "-m", "tests.utils.triton_interpret_batch", *specs],
                          cwd=str(ROOT), env=_env(), capture_output=True, text=True,
                          timeout=240 * len(drivers))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (
        f"the interpreter drivers crashed (exit {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {(Path(driver).name, tuple(args)): (code, out, err)
            for driver, args, code, out, err in json.loads(lines[-1])}


def _run_batch() -> dict:
    return _run_drivers([(UTILS / name, args) for name, args in BATCHED])


def run_interpreter_driver(driver: Path, args: tuple[str, ...] = ()) -> None:
    """`args` are passed to the driver (e.g. the names of the checks to run)."""
    global _batch_results
    key = (Path(driver).name, tuple(args))
    if Path(driver).resolve().parent == UTILS and key in BATCHED:
        if _batch_results is None:
            _batch_results = _run_batch()
        returncode, stdout, stderr = _batch_results[key]
    else:
        returncode, stdout, stderr = _run_drivers([(Path(driver), tuple(args))])[key]
    assert returncode == 0, stdout + stderr
    if "NO_TRITON" in stdout:
        pytest.skip("triton is not importable here")
    assert "TRITON_INTERPRET_OK" in stdout
