"""EngineArgs flags: generated from the dataclass (one flag per field, upstream names), dotted
--speculative-config keys, human-readable --max-model-len, and one-line refusals."""
import argparse
import json
from dataclasses import fields

import pytest

from vllm.engine.arg_utils import (EngineArgs, expand_dotted_args, human_readable_int,
                                   human_readable_int_or_auto)
from vllm.model_executor.models.tiny import write_tiny_models


def parse(argv):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(expand_dotted_args(argv)))


def test_every_field_has_its_flag_and_defaults_match():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


def test_upstream_launch_line_parses():
    args = parse(["-tp", "2", "-dcp", "2", "--dcp-kv-cache-interleave-size", "1",
                  "--gpu-memory-utilization", "0.85", "--max-model-len", "32k",
                  "--served-model-name", "a", "b", "--enforce-eager",
                  "--no-enable-prefix-caching", "--kv-cache-dtype", "auto",
                  "--distributed-executor-backend", "mp",
                  "--speculative-config.method", "dspark",
                  "--speculative-config.num_speculative_tokens", "4",
                  "--speculative-config.draft_tensor_parallel_size=2"])
    assert (args.tensor_parallel_size, args.decode_context_parallel_size) == (2, 2)
    assert args.cp_kv_cache_interleave_size == 1 and args.gpu_memory_utilization == 0.85
    assert args.max_model_len == 32000 and args.served_model_name == ["a", "b"]
    assert args.enforce_eager and args.enable_prefix_caching is False
    assert json.loads(args.speculative_config) == {"method": "dspark", "num_speculative_tokens": 4,
                                                   "draft_tensor_parallel_size": 2}
    config = args.create_engine_config()
    assert config.speculative_config.method == "dspark"
    assert config.speculative_config.num_speculative_tokens == 4
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert config.cache_config.gpu_memory_utilization == 0.85


def test_dotted_keys_merge_over_json_and_nest():
    argv = expand_dotted_args(["--speculative-config", '{"method": "eagle", "model": "/x"}',
                               "--speculative-config.method=dspark", "-O.cudagraph_capture_sizes",
                               "[1, 2]", "--compilation-config.a.b", "true"])
    assert argv[0] == "--speculative-config"
    assert json.loads(argv[1]) == {"method": "dspark", "model": "/x"}
    assert argv[2] == "--compilation-config"
    assert json.loads(argv[3]) == {"cudagraph_capture_sizes": [1, 2], "a": {"b": True}}
    with pytest.raises(ValueError, match="needs a value"):
        expand_dotted_args(["--speculative-config.method"])


def test_human_readable_max_model_len():
    assert human_readable_int("32k") == 32000  # upstream: lower case is decimal
    assert human_readable_int("32K") == 32768  # upper case is binary
    assert human_readable_int("25.6k") == 25600 and human_readable_int("4096") == 4096
    assert human_readable_int_or_auto("auto") is None and human_readable_int_or_auto("-1") is None
    with pytest.raises(argparse.ArgumentTypeError, match="1.5K"):
        human_readable_int("1.5K")


def test_max_model_len_above_the_model_is_refused_and_auto_works(monkeypatch):
    target = str(write_tiny_models().target)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=r"max_model_len=32000 \(--max-model-len\).*"
                                         "max_position_embeddings=4096"):
        parse([ "--model", target, "--max-model-len", "32k"]).create_engine_config()
    config = parse(["--model", target, "--max-model-len", "auto"]).create_engine_config()
    assert config.model_config.max_model_len == 4096
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert parse(["--model", target, "--max-model-len", "8K"]).create_engine_config() \
        .model_config.max_model_len == 8192


@pytest.mark.parametrize("argv, needle", [
    (["--enable-prefix-caching"], "--enable-prefix-caching"),
    (["-pp", "2"], "pipeline_parallel_size=2"),
    (["-dp", "2"], "data_parallel_size=2"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype='fp8'"),
    (["-tp", "2", "--speculative-config",
      '{"method": "dspark", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}'],
     "decoupled draft TP is not supported yet"),
    (["--speculative-config",
      '{"method": "dspark", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}'],
     "rejection_sample_method='synthetic' is not supported"),
    (["-tp", "2", "--distributed-executor-backend", "uni"], "'uni' runs one process"),
])
def test_refusals_are_one_line_naming_the_option(argv, needle):
    with pytest.raises(ValueError) as info:
        parse(argv).create_engine_config()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_ray_backend_is_refused_by_argparse_choices():
    with pytest.raises(SystemExit):
        parse(["--distributed-executor-backend", "ray"])


def test_upstream_rejection_method_names():
    args = parse(["--speculative-config.method", "dspark",
                  "--speculative-config.num_speculative_tokens", "2",
                  "--speculative-config.rejection_sample_method", "standard"])
    spec = args.create_engine_config().speculative_config
    assert spec.rejection_sample_method == "probabilistic"  # upstream "standard" = ours
