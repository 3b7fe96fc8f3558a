"""`vllm` command line: bad input ends with exit code != 0 and ONE line naming the problem.

Subprocess cases run the installed console script concurrently (each pays the torch import once);
cases that need a patched device or backend run `main()` in-process.
"""
import json
import shutil
import subprocess
import sys

import pytest

from vllm.entrypoints.cli.main import main

# name -> (argv after `vllm`, substrings the one-line error must contain)
SUBPROCESS_CASES = {
    "malformed_json": (["generate", "--speculative-config", '{"method": "dspark", "num_speculative_tokens": }'],
                       ["--speculative-config", "not valid JSON", "column"]),
    "unknown_spec_key": (["generate", "--speculative-config",
                          '{"method": "dspark", "num_speculative_tokens": 4, "num_spec_tokens": 2}'],
                         ["--speculative-config", "'num_spec_tokens'"]),
    # num_speculative_tokens may be omitted (it defaults from the drafter); method or model may not
    "missing_spec_key": (["generate", "--speculative-config", '{"num_speculative_tokens": 4}'],
                         ["--speculative-config", "'method'"]),
    "tp_not_multiple_of_dcp": (["generate", "-tp", "2", "-dcp", "3"],
                               ["decode_context_parallel_size=3", "tensor_parallel_size=2"]),
    "unknown_model_dir": (["serve", "/nonexistent/model-dir", "--port", "0"],
                          ["'/nonexistent/model-dir'", "does not exist"]),
    "bad_temperature": (["generate", "--temperature", "-1"], ["temperature=-1"]),
    "bad_max_tokens": (["generate", "--max-tokens", "0"], ["max_tokens=0"]),
    "missing_prompts_file": (["generate", "--prompts-file", "/nonexistent/prompts.txt"],
                             ["--prompts-file", "/nonexistent/prompts.txt"]),
    "unknown_flag": (["generate", "--no-such-flag"], ["--no-such-flag"]),
    "bench_bad_len": (["bench", "latency", "--input-len", "0"], ["--input-len", ">= 1"]),
    "bad_attention_backend": (["generate", "--attention-backend", "FAST_MLA"],
                              ["attention_backend='FAST_MLA'", "TORCH_MLA"]),
    # Upstream flags this engine cannot honour: refused in one line naming the option.
    "prefix_caching": (["generate", "--enable-prefix-caching"], ["--enable-prefix-caching"]),
    "pipeline_parallel": (["serve", "-pp", "2"], ["pipeline_parallel_size=2", "-pp"]),
    "fp8_kv_cache": (["generate", "--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8"]),
    "max_model_len_above_model": (["generate", "--max-model-len", "32k"],
                                  ["max_model_len=32000", "max_position_embeddings"]),
    "dotted_spec_missing_value": (["generate", "--speculative-config.method"],
                                  ["--speculative-config.method needs a value"]),
    "draft_tp": (["generate", "-tp", "2", "--speculative-config.method", "dspark",
                  "--speculative-config.num_speculative_tokens", "2",
                  "--speculative-config.draft_tensor_parallel_size", "1"],
                 ["draft_tensor_parallel_size", "decoupled draft TP is not supported yet"]),
}


# Paid in subprocesses (torch import each): the exit code and stderr of the real console script.
SUBPROCESS_NAMES = ("malformed_json", "tp_not_multiple_of_dcp", "unknown_model_dir", "bad_temperature")


@pytest.fixture(scope="module")
def cli_results():
    """Run the subprocess cases at once (2 cores: keep the wall time short)."""
    vllm_script = shutil.which("vllm")
    procs = {}
    for name in SUBPROCESS_NAMES:
        argv = SUBPROCESS_CASES[name][0]
        # one case goes through the installed `vllm` console script itself
        cmd = ([vllm_script] if vllm_script and name == "malformed_json"
               else [sys.executable, "-m", "vllm.entrypoints.cli.main"])
        procs[name] = subprocess.Popen(cmd + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    return {name: (p.wait(timeout=240), p.stdout.read(), p.stderr.read()) for name, p in procs.items()}


def check_one_line_error(code, stderr, needles):
    assert code not in (0, None), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr  # no traceback, no usage block
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("case", SUBPROCESS_NAMES)
def test_bad_input_subprocess(cli_results, case):
    code, _, stderr = cli_results[case]
    check_one_line_error(code, stderr, SUBPROCESS_CASES[case][1])


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    err = capsys.readouterr().err
    return excinfo.value.code, err


@pytest.mark.parametrize("case", sorted(set(SUBPROCESS_CASES) - set(SUBPROCESS_NAMES)))
def test_bad_input_in_process(case, capsys):
    code, err = run_main(SUBPROCESS_CASES[case][0], capsys)
    check_one_line_error(code, err, SUBPROCESS_CASES[case][1])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_gpu_refused(capsys):
    code, err = run_main(["generate", "--device", "cuda"], capsys)
    check_one_line_error(code, err, ["--device cuda", "no CUDA device"])


def test_flashinfer_dcp_interleave_refused_on_blackwell(monkeypatch, capsys):
    import vllm.entrypoints.cli.engine_setup as setup

    monkeypatch.setattr(setup, "device_capability", lambda: (10, 0))
    code, err = run_main(["generate", "-tp", "2", "-dcp", "2", "--cp-kv-cache-interleave-size", "4",
                          "--attention-backend", "FLASHINFER_MLA", "--block-size", "32"], capsys)
    check_one_line_error(code, err, ["--cp-kv-cache-interleave-size 4", "Blackwell"])


def test_flashinfer_dcp_interleave_allowed_on_hopper(monkeypatch):
    """Same flags on sm90 pass the early check (the Blackwell rule must not over-reach)."""
    import vllm.entrypoints.cli.engine_setup as setup
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(setup, "device_capability", lambda: (9, 0))
    from vllm.model_executor.models.tiny import write_tiny_models

    config = EngineArgs(model=write_tiny_models().target, tensor_parallel_size=2,
                        decode_context_parallel_size=2, cp_kv_cache_interleave_size=4,
                        block_size=32, attention_backend="FLASHINFER_MLA").create_engine_config()
    setup.preflight(config)  # no exception


def test_non_causal_draft_on_incapable_backend_refused(monkeypatch, capsys):
    from vllm.v1.attention.backends.mla.torch_mla import TorchMLAMetadataBuilder

    monkeypatch.setattr(TorchMLAMetadataBuilder, "supports_non_causal_multi_token_dcp", False)
    code, err = run_main(["generate", "-tp", "2", "-dcp", "2", "--attention-backend", "TORCH_MLA"],
                         capsys)
    check_one_line_error(code, err, ["TorchMLAMetadataBuilder", "supports_non_causal_multi_token_dcp",
                                     "decode_context_parallel_size=1"])


def test_tiny_model_command_writes_loadable_dirs(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["tiny-model", "--output", str(tmp_path / "tiny"), "--train-steps", "0"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    for name in ("target", "eagle", "mtp", "dflash", "dspark"):
        assert (tmp_path / "tiny" / name / "config.json").is_file()
        assert str(tmp_path / "tiny" / name) in out
    with open(tmp_path / "tiny" / "dspark" / "config.json") as f:
        assert json.load(f)["architectures"] == ["DSparkMLAForCausalLM"]


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "generate", "bench", "tiny-model"):
        assert command in out
