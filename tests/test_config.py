import argparse
import json

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("make,needles", [
    (lambda: ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3),
     ["decode_context_parallel_size=3", "tensor_parallel_size=4", "multiple"]),
    (lambda: ParallelConfig(tensor_parallel_size=0), ["tensor_parallel_size=0", ">= 1"]),
    (lambda: ParallelConfig(cp_kv_cache_interleave_size=-2), ["cp_kv_cache_interleave_size=-2"]),
    (lambda: ParallelConfig(distributed_backend="mpi"), ["distributed_backend='mpi'", "gloo"]),
    (lambda: VllmConfig(cache_config=CacheConfig(block_size=16),
                        parallel_config=ParallelConfig(tensor_parallel_size=2,
                                                       decode_context_parallel_size=2,
                                                       cp_kv_cache_interleave_size=3)),
     ["block_size=16", "cp_kv_cache_interleave_size=3", "multiple"]),
    (lambda: CacheConfig(block_size=0), ["block_size=0", ">= 1"]),
    (lambda: CacheConfig(cache_dtype="fp8"), ["cache_dtype='fp8'", "bfloat16"]),
    (lambda: CacheConfig(kv_cache_memory_bytes=0), ["kv_cache_memory_bytes=0"]),
    (lambda: ModelConfig(dtype="int8"), ["dtype='int8'", "bfloat16"]),
    (lambda: ModelConfig(max_model_len=0), ["max_model_len=0"]),
    (lambda: ModelConfig(attention_backend="FLASH_ATTN"), ["attention_backend='FLASH_ATTN'",
                                                           "TORCH_MLA"]),
    (lambda: ModelConfig(device="tpu"), ["device='tpu'", "cuda"]),
    (lambda: SpeculativeConfig("medusa", None, 2), ["method='medusa'", "dspark"]),
    (lambda: SpeculativeConfig("eagle", None, 0), ["num_speculative_tokens=0", ">= 1"]),
    (lambda: SpeculativeConfig("eagle", None, 2, draft_sample_method="beam"),
     ["draft_sample_method='beam'", "probabilistic"]),
    (lambda: SpeculativeConfig("eagle", None, 2, rejection_sample_method="lenient"),
     ["rejection_sample_method='lenient'", "strict"]),
    (lambda: VllmConfig(max_num_seqs=0), ["max_num_seqs=0"]),
    (lambda: VllmConfig(max_num_batched_tokens=-1), ["max_num_batched_tokens=-1"]),
])
def test_invalid_values_name_field_value_and_allowed(make, needles):
    with pytest.raises(ValueError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_speculative_config_from_json():
    spec = SpeculativeConfig.from_json('{"method": "DSpark", "num_speculative_tokens": 4}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("dspark", None, 4)
    assert spec.uses_block_drafter
    spec = SpeculativeConfig.from_json({"method": "eagle", "model": "/d", "num_speculative_tokens": 3,
                                        "draft_sample_method": "probabilistic",
                                        "rejection_sample_method": "probabilistic"})
    assert spec.to_dict() == {"method": "eagle", "model": "/d", "num_speculative_tokens": 3,
                              "draft_sample_method": "probabilistic",
                              "rejection_sample_method": "probabilistic",
                              "disable_by_batch_size": None,
                              "draft_tensor_parallel_size": None,
                              "draft_decode_context_parallel_size": None}
    with pytest.raises(ValueError, match="unknown key 'num_spec_tokens'"):
        SpeculativeConfig.from_json('{"method": "mtp", "num_spec_tokens": 2}')
    with pytest.raises(ValueError, match="line 1 column 12"):
        SpeculativeConfig.from_json('{"method": dspark}')
    # k may be omitted (it defaults from the draft config), but method or model must be given
    assert SpeculativeConfig.from_json('{"method": "deepseek_mtp"}').method == "mtp"
    with pytest.raises(ValueError, match="needs 'method'"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="JSON object"):
        SpeculativeConfig.from_json("[1, 2]")


def test_model_config_dtype_device_and_lazy_hf_config(tmp_path):
    cfg = ModelConfig()
    assert cfg.model is None and cfg.max_model_len is None  # None-tolerant until resolved
    assert cfg.resolved_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert ModelConfig(device="cpu").torch_dtype == torch.float32
    assert ModelConfig(device="cuda").torch_dtype == torch.bfloat16  # no GPU needed to resolve
    assert ModelConfig(dtype="half").torch_dtype == torch.float16
    assert ModelConfig(dtype=torch.bfloat16).torch_dtype == torch.bfloat16
    assert ModelConfig(attention_backend="torch_mla").attention_backend == "TORCH_MLA"
    with pytest.raises(ValueError, match="model=None"):
        cfg.hf_config
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 333,
                                                      "hidden_size": 8}))
    cfg = ModelConfig(model=tmp_path)
    assert cfg.model == str(tmp_path)
    assert cfg.max_model_len == 333 and cfg.hf_config.hidden_size == 8
    assert ModelConfig(model=str(tmp_path), max_model_len=100).max_model_len == 100
    late = ModelConfig()
    late.model = str(tmp_path)  # what the engine does after writing the tiny model
    assert late.max_model_len == 333
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(model=str(tmp_path / "missing")).hf_config


def test_cache_dtype_resolution():
    assert CacheConfig().resolve_cache_dtype(torch.float32) == torch.float32
    assert CacheConfig(cache_dtype="bfloat16").resolve_cache_dtype(torch.float32) == torch.bfloat16


def test_engine_args_cli_round_trip():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args([
        "--model", "/m", "-tp", "4", "-dcp", "2", "--cp-kv-cache-interleave-size", "4",
        "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}',
        "--attention-backend", "TORCH_MLA", "--max-model-len", "512", "--block-size", "32",
        "--dtype", "float32", "--seed", "7", "--max-num-seqs", "5",
        "--kv-cache-memory-bytes", "1000000", "--device", "cpu"])
    args = EngineArgs.from_cli_args(ns)
    assert args.tensor_parallel_size == 4 and args.decode_context_parallel_size == 2
    cfg = args.create_engine_config()
    assert isinstance(cfg, VllmConfig)
    assert cfg.parallel_config.world_size == 4 and cfg.parallel_config.dcp_size == 2
    assert cfg.parallel_config.cp_kv_cache_interleave_size == 4
    assert cfg.speculative_config.method == "dspark"
    assert cfg.speculative_config.num_speculative_tokens == 3 and cfg.num_speculative_tokens == 3
    assert cfg.model_config.model == "/m" and cfg.model_config.max_model_len == 512
    assert cfg.model_config.attention_backend == "TORCH_MLA" and cfg.model_config.seed == 7
    assert cfg.cache_config.block_size == 32 and cfg.cache_config.kv_cache_memory_bytes == 1000000
    assert cfg.max_num_seqs == 5 and cfg.model_config.torch_dtype == torch.float32
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert defaults == EngineArgs()
    assert defaults.create_engine_config().speculative_config is None


def test_engine_args_validation_flows_through():
    with pytest.raises(ValueError, match="unknown key 'foo'"):
        EngineArgs(speculative_config='{"method": "eagle", "num_speculative_tokens": 1, "foo": 1}'
                   ).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(tensor_parallel_size=2, decode_context_parallel_size=4).create_engine_config()
    cfg = EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 1}
                     ).create_engine_config()
    assert cfg.speculative_config.method == "mtp"
