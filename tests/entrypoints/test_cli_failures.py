"""Issue 14, failure 7: run-time and environment problems end the CLI with ONE line, no traceback.

Each case failed before (a traceback, or a silently created directory).
"""
import os
import shutil

import pytest

from vllm.entrypoints.cli.main import main
from vllm.v1.executor.abstract import WorkerError


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    return excinfo.value.code, capsys.readouterr().err


def check_one_line_error(code, stderr, needles):
    assert code not in (0, None), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU message")
def test_nccl_backend_on_cpu(capsys):
    code, err = run_main(["generate", "-tp", "2", "--device", "cpu", "--distributed-backend",
                          "nccl", "--no-progress"], capsys)
    check_one_line_error(code, err, ["--distributed-backend nccl", "gloo"])


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_port_out_of_range(capsys, port):
    code, err = run_main(["serve", "--port", port], capsys)
    check_one_line_error(code, err, ["--port", port])


def test_truncated_safetensors(tmp_path, capsys):
    from vllm.model_executor.models.tiny import write_tiny_models

    model = tmp_path / "target"
    shutil.copytree(write_tiny_models().target, model)
    weights = sorted(p for p in os.listdir(model) if p.endswith(".safetensors"))[0]
    path = model / weights
    os.truncate(path, os.path.getsize(path) // 2)
    code, err = run_main(["generate", str(model), "--device", "cpu", "--no-progress"], capsys)
    check_one_line_error(code, err, [weights, "truncated"])


def test_bench_output_json_in_missing_dir_is_refused(tmp_path, capsys):
    target = tmp_path / "nonexistent" / "dir" / "r.json"
    code, err = run_main(["bench", "latency", "--output-json", str(target)], capsys)
    check_one_line_error(code, err, ["--output-json", "does not exist"])
    assert not (tmp_path / "nonexistent").exists()  # nothing created


def test_worker_death_during_generate(monkeypatch, capsys):
    """The executor's failure (what a SIGKILLed rank produces, with the rank's traceback in it)
    becomes one line naming the rank; the real kill is in tests/reliability."""
    from vllm.v1.engine.llm_engine import LLMEngine

    def dies(self):
        raise WorkerError("worker rank 1 died during `execute_model` (exit code -9)\n"
                          "Traceback (most recent call last):\n  ...\nRuntimeError: boom")

    monkeypatch.setattr(LLMEngine, "step", dies)
    code, err = run_main(["generate", "--device", "cpu", "--no-progress", "--max-tokens", "2"],
                         capsys)
    check_one_line_error(code, err, ["worker rank 1 died during `execute_model`", "boom"])


def test_generate_top_k_beyond_int64_is_one_line(capsys):
    code, err = run_main(["generate", "--device", "cpu", "--no-progress", "--top-k",
                          str(2**63)], capsys)
    check_one_line_error(code, err, ["top_k=9223372036854775808", "2147483647"])
