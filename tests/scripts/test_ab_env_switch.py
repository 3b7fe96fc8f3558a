"""scripts/ab_env_switch.py stays runnable on CPU: one table row per (batch, setting) with the
variant / baseline ratio, a switch that is not the engine's refused, and the environment left as
it was."""
import json

from tests.utils.scripts import run_script


def test_cpu_smoke_run_gives_a_row_per_batch_and_setting(tmp_path):
    out = tmp_path / "ab.json"
    done = run_script("ab_env_switch.py", "--switch", "VLLM_FUSED_DRAFT_PLAN_LOWERING",
                      "--variants", "none", "always", "--batch-sizes", "1", "2", "--rounds", "1",
                      "--warmup-rounds", "0", "--output-len", "12", "--warmup-steps", "2",
                      "--device", "cpu", "--dtype", "float32", "--attention-backend",
                      "TORCH_MLA", "--enforce-eager", "--json", str(out))
    rows = [line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [(r[0], r[1]) for r in rows] == [("| 1", "0"), ("| 1", "1"), ("| 2", "0"),
                                            ("| 2", "1")], done.stdout
    assert all(float(r[-1].rstrip(" |")) > 0 for r in rows)
    result = json.loads(out.read_text())
    # every (setting, batch, variant) ran once, and the table's medians are those runs
    assert sorted(result["tok_s"]) == sorted(f"{s}:{b}:{v}" for s in "01" for b in (1, 2)
                                             for v in ("none", "always"))
    for row in result["rows"]:
        key = f"{row['setting']}:{row['batch']}"
        assert row["always/none"] == result["tok_s"][f"{key}:always"][0] / result["tok_s"][
            f"{key}:none"][0]


def test_a_switch_that_is_not_the_engines_is_refused():
    done = run_script("ab_env_switch.py", "--switch", "PATH", check=False)
    assert done.returncode == 2 and "VLLM_" in done.stderr
