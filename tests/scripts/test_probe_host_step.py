"""scripts/probe_host_step.py stays runnable on CPU: a short run reports every timed phase for
every batch size (its forward stub: tests/benchmarks/test_host_stub.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "probe_host_step.py"


def test_short_run_reports_every_phase(tmp_path):
    out = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--batch", "1", "3", "--steps", "5",
                    "--context", "8", "--json", str(out)], check=True, cwd=ROOT,
                   env=env, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["step_ms"] > 0
        for phase in ("scheduler.schedule", "runner._prepare_inputs",
                      "scheduler.update_from_output", "engine._process_step (incl. update)"):
            assert r["phases_ms"][phase] > 0, phase
