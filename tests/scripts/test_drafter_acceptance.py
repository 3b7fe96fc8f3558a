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


def test_a_drafter_of_another_layer_count_is_refused_not_cut(tmp_path):
    """A 2-layer drafter read as 3 layers (and a 3-layer one as the shipped 2) must stop with
    the fix named, not crash on a missing key or silently run a subset of its layers."""
    from safetensors.torch import load_file, save_file

    from vllm.model_executor.models import tiny

    shipped = load_file(f"{tiny.shipped_weights_dir()}/dspark.safetensors")
    small = ("--prompt-sets", "bench", "--batch", "2", "--context", "16", "--output-len", "24")
    done = run_script("drafter_acceptance.py", "--num-layers", "3", *small, check=False)
    assert done.returncode != 0 and "do not fit a DSpark of 3 layers" in done.stderr
    assert "--num-layers" in done.stderr
    extra = dict(shipped)  # a third layer: layer 1's tensors under layer 2's names
    extra.update({k.replace("layers.1.", "layers.2."): v.clone() for k, v in shipped.items()
                  if "layers.1." in k})
    save_file(extra, str(tmp_path / "dspark.safetensors"))
    done = run_script("drafter_acceptance.py", "--drafters", tmp_path, *small, check=False)
    assert done.returncode != 0 and "do not fit a DSpark of 2 layers" in done.stderr
    done = run_script("drafter_acceptance.py", "--drafters", tmp_path, "--num-layers", "3", *small)
    assert f"| {tmp_path} | bench |" in done.stdout
