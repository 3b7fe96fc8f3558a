"""scripts/trace_policy_steps.py: the full-batch / tail split of a speculative run (a batch's
requests finish in different steps, so its last steps run part-empty), and a CPU smoke run
that prints it."""
from tests.utils.scripts import load_script, run_script


def test_tail_summary_splits_steps_by_running_requests():
    log = [{"rows": 4, "ms": 2.0, "tokens": 12}, {"rows": 4, "ms": 2.0, "tokens": 8},
           {"rows": 3, "ms": 1.0, "tokens": 3}, {"rows": 1, "ms": 1.0, "tokens": 1}]
    line = load_script("trace_policy_steps.py").tail_summary(log, 4)
    assert line == ("full batch: 2 steps, 4.0 ms, 20 tokens, 5000 tok/s; "
                    "tail: 2 steps, 2.0 ms, 4 tokens, 2000 tok/s")


def test_cpu_trace_prints_the_tail_summary():
    done = run_script("trace_policy_steps.py", "--batch-sizes", "2", "--variants", "always",
                      "--rounds", "1", "--output-len", "24", "--warmup-steps", "2", "--device",
                      "cpu", "--dtype", "float32", "--attention-backend", "TORCH_MLA",
                      "--enforce-eager")
    summary = [line for line in done.stdout.splitlines() if "full batch:" in line]
    assert len(summary) == 1 and "; tail: " in summary[0], done.stdout
