"""scripts/time_step_host.py stays runnable on CPU: a short interleaved run prints one row per
variant (the first one's ratio exactly 1) and, with --phases, the phases every engine runs;
several --prompt-stagger values give one engine per (variant, stagger) in the same process."""
from tests.utils.scripts import run_script


def test_short_run_prints_every_variant_and_phase():
    done = run_script("time_step_host.py", "--variants", "none", "never", "--batch", "2",
                      "--rounds", "2", "--block", "3", "--warmup-steps", "4", "--phases")
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines()
            if line.startswith("| none |") or line.startswith("| never |")
            or line.startswith("| scheduler.schedule |")}
    assert set(rows) == {"none", "never", "scheduler.schedule"}, done.stdout
    cells = [c.strip() for c in rows["none"].split("|")[1:-1]]
    assert cells[-1] == "1.000" and cells[-2] == "+0.0", cells  # the base against itself
    assert float(cells[1]) > 0  # host us per step
    schedule = [c.strip() for c in rows["scheduler.schedule"].split("|")[1:-1]]
    assert len(schedule) == 3 and all(float(v) > 0 for v in schedule[1:]), schedule


def test_several_staggers_build_one_engine_each():
    done = run_script("time_step_host.py", "--variants", "none", "--batch", "2", "--rounds",
                      "2", "--block", "3", "--warmup-steps", "4", "--prompt-stagger", "0", "3")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in done.stdout.splitlines() if line.startswith("| none@")}
    assert set(rows) == {"none@0", "none@3"}, done.stdout
    assert rows["none@0"][-3:] == ["+0.0", "+0.0", "1.000"], rows  # the base against itself
    assert float(rows["none@3"][4]) > 0  # its mean host us per step (GPU-like)
    bad = run_script("time_step_host.py", "--prompt-stagger", "2", "2", check=False,
                     timeout=120)
    assert bad.returncode == 2 and "distinct values" in bad.stderr, bad.stderr
