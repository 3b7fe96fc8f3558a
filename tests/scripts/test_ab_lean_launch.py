"""scripts/ab_lean_launch.py stays runnable on CPU: one table row per (batch, setting) with the
variant / baseline ratio, and the launchers switched back off afterwards."""
from tests.utils.scripts import run_script


def test_cpu_smoke_run_gives_a_row_per_batch_and_setting():
    done = run_script("ab_lean_launch.py", "--variants", "none", "never", "--batch-sizes", "1",
                      "2", "--rounds", "1", "--warmup-rounds", "0", "--output-len", "12",
                      "--warmup-steps", "2", "--device", "cpu", "--dtype", "float32",
                      "--attention-backend", "TORCH_MLA", "--enforce-eager")
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "off"), ("| 1", "on"), ("| 2", "off"),
                                            ("| 2", "on")], done.stdout
    assert all(float(r[-1].rstrip(" |")) > 0 for r in rows)
    assert "launches (lean, through Triton):" in done.stdout
