"""Checkpoint loading: get_model from a directory (single file and sharded index), clear errors
for missing / mis-shaped / foreign tensors, config + tokenizer from the directory."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.config import ModelConfig, VllmConfig
from vllm.forward_context import dense_attention_context
from vllm.model_executor.model_loader import get_model, iterate_safetensors
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.tiny import (BOS_ID, EOS_ID, PAD_ID, target_tensor_shapes, tiny_target_config,
                                             write_random_target)
from vllm.transformers_utils.config import load_hf_config
from vllm.transformers_utils.tokenizer import get_tokenizer

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
             num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None)


def _vllm_config(model_dir: str) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", device="cpu",
                                               attention_backend="TORCH_MLA"))


def test_get_model_loads_every_tensor(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    model = get_model(_vllm_config(str(tmp_path)))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    params = dict(model.named_parameters())
    # routed experts are stacked: w2_weight [E, D, I], w13_weight [E, 2I, D] (gate rows, then up)
    torch.testing.assert_close(params["model.layers.1.mlp.experts.w2_weight"][2],
                               on_disk["model.layers.1.mlp.experts.2.down_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(params["model.layers.1.mlp.experts.w13_weight"][3],
                               torch.cat([on_disk["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                          on_disk["model.layers.1.mlp.experts.3.up_proj.weight"]]), rtol=0, atol=0)
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(gate_up, torch.cat([on_disk["model.layers.0.mlp.gate_proj.weight"],
                                                   on_disk["model.layers.0.mlp.up_proj.weight"]]), rtol=0, atol=0)
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert not model.training


def test_sharded_checkpoint_gives_same_model(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    write_random_target(str(single), seed=5, **SMALL)
    write_random_target(str(sharded), seed=5, num_shards=3, **SMALL)
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert not os.path.exists(sharded / "model.safetensors")
    a, b = get_model(_vllm_config(str(single))), get_model(_vllm_config(str(sharded)))
    ids = torch.tensor([1, 2, 3, 250])
    with torch.no_grad(), dense_attention_context():
        torch.testing.assert_close(a.compute_logits(a(ids, torch.arange(4))),
                                   b.compute_logits(b(ids, torch.arange(4))), rtol=0, atol=0)


def _rewrite(model_dir, edit):
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    _rewrite(str(tmp_path), lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        get_model(_vllm_config(str(tmp_path)))


def test_missing_half_of_fused_projection_is_named(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    _rewrite(str(tmp_path), lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.0\.mlp\.up_proj\.weight"):
        get_model(_vllm_config(str(tmp_path)))


def test_misshaped_tensor_names_tensor_and_both_shapes(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(str(tmp_path), lambda t: t.__setitem__(name, torch.zeros(64, 60)))
    with pytest.raises(ValueError) as err:
        get_model(_vllm_config(str(tmp_path)))
    msg = str(err.value)
    assert name in msg and "(64, 60)" in msg and "(64, 64)" in msg


def test_foreign_tensor_is_rejected_but_mtp_layers_are_skipped(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    # DeepSeek checkpoints carry the MTP layer as model.layers.{num_hidden_layers}: ignored
    _rewrite(str(tmp_path), lambda t: t.__setitem__("model.layers.2.eh_proj.weight", torch.zeros(64, 128)))
    get_model(_vllm_config(str(tmp_path)))
    _rewrite(str(tmp_path), lambda t: t.__setitem__("model.bogus.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"'model\.bogus\.weight' matches no parameter"):
        get_model(_vllm_config(str(tmp_path)))


def test_missing_weights_and_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_target_config(**SMALL)))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        list(iterate_safetensors(str(tmp_path)))


def test_hf_config_attribute_access_and_defaults(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    cfg = load_hf_config(str(tmp_path))
    assert cfg.hidden_size == 64 and cfg.q_lora_rank is None and cfg.kv_lora_rank == 512
    assert cfg.get("no_such_key", 7) == 7 and "hidden_size" in cfg
    del_cfg = cfg.to_dict()
    del_cfg.pop("rope_interleave")
    (tmp_path / "config.json").write_text(json.dumps(del_cfg))
    assert load_hf_config(str(tmp_path)).rope_interleave is True  # DeepSeek default
    with pytest.raises(AttributeError, match="no_such_key"):
        _ = cfg.no_such_key
    import copy
    import pickle
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):  # configs travel to workers
        assert clone.to_dict() == cfg.to_dict() and clone.path == cfg.path


def test_byte_tokenizer_roundtrip(tmp_path):
    write_random_target(str(tmp_path), seed=5, **SMALL)
    tok = get_tokenizer(str(tmp_path))
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # token id == byte value
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.decode(ids + [EOS_ID]) == text
    assert tok.decode([EOS_ID], skip_special_tokens=False) == "<|eos|>"
    assert tok.vocab_size == 260


def test_tensor_shape_table_matches_model_parameters():
    """The writer's shape table (what checkpoints hold) and the model agree name for name."""
    cfg = load_hf_config_from_dict(tiny_target_config())
    model = DeepseekV3ForCausalLM(hf_config=cfg)
    from vllm.model_executor.models.weight_loading import checkpoint_names_of
    names = {ck for n, p in model.named_parameters() for ck, _ in checkpoint_names_of(n, p)}
    assert names == set(target_tensor_shapes(tiny_target_config()))


def load_hf_config_from_dict(values):
    from vllm.transformers_utils.config import HFConfig
    return HFConfig(values)
