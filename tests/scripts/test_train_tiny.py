"""scripts/train_tiny.py refuses what it cannot honour before any training starts, naming the
bad value and the fix."""
import pytest

from tests.utils.scripts import run_script


@pytest.mark.parametrize("args,message", [
    (("--row-decay", "0"), "--row-decay must be > 0, got 0.0"),
    (("--dspark-layers", "0", "--drafters", "dspark", "--skip-target"),
     "--dspark-layers must be >= 1, got 0"),
    (("--dspark-layers", "3", "--skip-target"), "distil it alone (--drafters dspark)"),
    (("--resume", "--drafters", "dspark", "--skip-target"),
     "dspark.safetensors, which do not exist"),
])
def test_refusals_name_the_value_and_the_fix(tmp_path, args, message):
    done = run_script("train_tiny.py", *args, "--out", tmp_path, check=False, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-500:]
    assert not list(tmp_path.iterdir())  # nothing written


def test_layers_for_the_package_itself_are_refused():
    done = run_script("train_tiny.py", "--dspark-layers", "3", "--drafters", "dspark",
                      "--skip-target", check=False, timeout=120)
    assert done.returncode != 0 and "not the package" in done.stderr
