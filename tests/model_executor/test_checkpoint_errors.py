"""Broken checkpoints fail with ONE line that names the file: truncated / corrupt safetensors,
corrupt config.json, an unsupported quantisation method, a bad --load-format."""
import os

import pytest

from vllm.config import LoadConfig, ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.tiny import write_random_target

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None)


def _load(model_dir):
    return get_model(VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", device="cpu")))


def _one_line(info, *needles):
    text = str(info.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)


def test_truncated_safetensors(tmp_path):
    d = write_random_target(str(tmp_path / "m"), seed=0, **SMALL)
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError) as info:
        _load(d)
    _one_line(info, path, "truncated or corrupt")


def test_garbage_safetensors(tmp_path):
    d = write_random_target(str(tmp_path / "m"), seed=0, **SMALL)
    path = os.path.join(d, "model.safetensors")
    with open(path, "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError) as info:
        _load(d)
    _one_line(info, path, "not a readable safetensors file")


def test_corrupt_config_json(tmp_path):
    d = write_random_target(str(tmp_path / "m"), seed=0, **SMALL)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"hidden_size": 64,, }')
    with pytest.raises(ValueError) as info:
        _load(d)
    _one_line(info, os.path.join(d, "config.json"), "is not valid JSON", "line 1 column")


def test_corrupt_index(tmp_path):
    d = write_random_target(str(tmp_path / "m"), seed=0, num_shards=2, **SMALL)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(ValueError) as info:
        _load(d)
    _one_line(info, "model.safetensors.index.json is not a valid safetensors index")


def test_unsupported_quant_method_named(tmp_path):
    d = write_random_target(str(tmp_path / "m"), seed=0, **SMALL,
                            quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError) as info:
        _load(d)
    _one_line(info, "quantization method 'awq' is not supported", "config.json")


def test_load_format_values():
    assert LoadConfig().load_format == "auto"
    with pytest.raises(ValueError, match=r"load_format='pt' is invalid: allowed values are "
                                         r"\['auto', 'safetensors', 'dummy'\]"):
        EngineArgs(load_format="pt").create_engine_config()
