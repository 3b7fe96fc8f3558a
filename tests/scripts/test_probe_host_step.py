"""scripts/probe_host_step.py stays runnable on CPU: its stubbed forward really replaces the model
(greedy decoding then emits the stub's fixed token), and a short run reports every timed phase
for every batch size."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "probe_host_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("probe_host_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubbed_forward_drives_greedy_decoding():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    probe = _load()
    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=64, max_num_seqs=2))
    try:
        probe._stub_forward(engine.executor.worker.model_runner)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("a", [5, 9, 13], params)
        engine.add_request("b", [2, 4], params)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out.outputs[0].token_ids
        assert final == {"a": [7] * 6, "b": [7] * 6}  # the stub's logits put the max on token 7
    finally:
        engine.shutdown()


def test_short_run_reports_every_phase(tmp_path):
    out = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--batch", "1", "3", "--steps", "5",
                    "--context", "8", "--json", str(out)], check=True, cwd=ROOT,
                   env=env, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["step_ms"] > 0
        for phase in ("scheduler.schedule", "runner._prepare_inputs",
                      "scheduler.update_from_output", "engine._process_step (incl. update)"):
            assert r["phases_ms"][phase] > 0, phase
