"""scripts/drafter_acceptance.py: one table row per (drafter, prompt set), its JSON holding the
per-request walk, and a clear exit for a directory without weights."""
import json

from tests.utils.scripts import run_script


def test_rows_and_json_for_the_shipped_drafter(tmp_path):
    out = tmp_path / "acc.json"
    done = run_script("drafter_acceptance.py", "--prompt-sets", "bench", "textwrap", "--batch", "2",
                      "--context", "16", "--output-len", "24", "--json", out)
    rows = [line for line in done.stdout.splitlines() if "tiny_weights |" in line]
    assert [r.split(" | ")[1] for r in rows] == ["bench", "textwrap"], done.stdout
    data = json.loads(out.read_text())
    assert [len(d["steps"]) for d in data] == [2, 2]
    for d in data:  # 23 tokens after the prefill's, at most 5 a step
        assert all(5 <= s <= 23 for s in d["steps"])
        assert d["ceilings"]["B=2"] == 23 / max(d["steps"])


def test_a_directory_without_weights_is_named(tmp_path):
    done = run_script("drafter_acceptance.py", "--drafters", tmp_path, check=False)
    assert done.returncode != 0 and str(tmp_path) in done.stderr
