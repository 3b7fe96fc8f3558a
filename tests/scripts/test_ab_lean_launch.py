"""scripts/ab_lean_launch.py stays runnable on CPU: one table row per (batch, setting) with the
variant / baseline ratio, and the launchers switched back off afterwards."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "ab_lean_launch.py"


def test_cpu_smoke_run_gives_a_row_per_batch_and_setting():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--variants", "none", "never",
                           "--batch-sizes", "1", "2", "--rounds", "1", "--warmup-rounds", "0",
                           "--output-len", "12", "--warmup-steps", "2", "--device", "cpu",
                           "--dtype", "float32", "--attention-backend", "TORCH_MLA",
                           "--enforce-eager"],
                          check=True, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "off"), ("| 1", "on"), ("| 2", "off"),
                                            ("| 2", "on")], done.stdout
    assert all(float(r[-1].rstrip(" |")) > 0 for r in rows)
    assert "launches (lean, through Triton):" in done.stdout
