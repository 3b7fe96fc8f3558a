"""scripts/probe_host_step.py stays runnable on CPU: a short run reports every timed phase for
every batch size (its forward stub: tests/benchmarks/test_host_stub.py)."""
import json

from tests.utils.scripts import run_script


def test_short_run_reports_every_phase(tmp_path):
    out = tmp_path / "probe.json"
    run_script("probe_host_step.py", "--batch", "1", "3", "--steps", "5", "--context", "8",
               "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["step_ms"] > 0
        for phase in ("scheduler.schedule", "runner._prepare_inputs",
                      "scheduler.update_from_output", "engine._process_step (incl. update)"):
            assert r["phases_ms"][phase] > 0, phase
