"""scripts/trace_policy_steps.py: the full-batch / tail split of a speculative run (a batch's
requests finish in different steps, so its last steps run part-empty), and a CPU smoke run
that prints it."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "trace_policy_steps.py"


def _script():
    spec = importlib.util.spec_from_file_location("trace_policy_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tail_summary_splits_steps_by_running_requests():
    log = [{"rows": 4, "ms": 2.0, "tokens": 12}, {"rows": 4, "ms": 2.0, "tokens": 8},
           {"rows": 3, "ms": 1.0, "tokens": 3}, {"rows": 1, "ms": 1.0, "tokens": 1}]
    line = _script().tail_summary(log, 4)
    assert line == ("full batch: 2 steps, 4.0 ms, 20 tokens, 5000 tok/s; "
                    "tail: 2 steps, 2.0 ms, 4 tokens, 2000 tok/s")


def test_cpu_trace_prints_the_tail_summary():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch-sizes", "2", "--variants",
                           "always", "--rounds", "1", "--output-len", "24", "--warmup-steps",
                           "2", "--device", "cpu", "--dtype", "float32",
                           "--attention-backend", "TORCH_MLA", "--enforce-eager"],
                          check=True, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    summary = [line for line in done.stdout.splitlines() if "full batch:" in line]
    assert len(summary) == 1 and "; tail: " in summary[0], done.stdout
