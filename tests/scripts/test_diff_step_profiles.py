"""scripts/diff_step_profiles.py stays runnable on CPU: engines profiled in turn (interleaved
blocks) give one table per later variant, each with the steps asked for."""
from tests.utils.scripts import run_script


def test_interleaved_profiles_give_one_table_per_later_variant():
    done = run_script("diff_step_profiles.py", "--variants", "none", "never",
                      "auto-nopay-noprobe", "--batch", "2", "--steps", "5", "--block", "2",
                      "--warmup-steps", "4", "--top", "3", "--stub-forward", "--callers", "copy_",
                      "--device", "cpu", "--dtype", "float32", "--attention-backend", "TORCH_MLA")
    titles = [line for line in done.stdout.splitlines() if line.startswith("#### ")]
    assert [t.split(" over ")[0] for t in titles] == ["#### never", "#### auto-nopay-noprobe"]
    assert all(", 5 steps," in t for t in titles), titles
    rows = [line for line in done.stdout.splitlines() if line.startswith("| +")
            or line.startswith("| -")]
    assert len(rows) == 12, done.stdout  # --top 3 rows in each table and call-site table
    # --callers: a call-site table per later variant, whose rows name the callers of copy_
    sites = [line for line in done.stdout.splitlines() if "call site ('copy_')" in line]
    assert len(sites) == 2, done.stdout
    site_rows = [line for line in done.stdout.splitlines() if " <- " in line]
    assert site_rows and all("copy_" in row.split(" <- ")[0] for row in site_rows), site_rows
