"""The built-in tiny model family: written once from a seed, loadable by Hugging Face with no
missing/unexpected keys, and with non-degenerate next-token distributions."""
import json
import os

import pytest
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.forward_context import dense_attention_context
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.tiny import write_tiny_models


def test_write_is_idempotent_and_seeded(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TINY_MODEL_DIR", str(tmp_path / "env"))
    paths = write_tiny_models(train_steps=0)
    assert paths.target.startswith(str(tmp_path / "env"))
    for d in (paths.target, paths.eagle, paths.mtp, paths.dflash, paths.dspark):
        assert os.path.isfile(os.path.join(d, "config.json")) and os.path.isfile(os.path.join(d, "model.safetensors"))
    stamp = os.path.getmtime(os.path.join(paths.target, "model.safetensors"))
    assert write_tiny_models(train_steps=0) == paths
    assert os.path.getmtime(os.path.join(paths.target, "model.safetensors")) == stamp  # not rewritten
    other = write_tiny_models(cache_dir=str(tmp_path / "again"), seed=0, train_steps=0)
    with open(os.path.join(paths.target, "model.safetensors"), "rb") as a, \
            open(os.path.join(other.target, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()  # same seed, same bytes
    os.remove(os.path.join(paths.dspark, "config.json"))  # incomplete -> rewritten
    write_tiny_models(train_steps=0)
    assert os.path.isfile(os.path.join(paths.dspark, "config.json"))


def test_tiny_target_is_hf_loadable_and_has_real_mla_dims(tmp_path):
    import transformers
    paths = write_tiny_models(cache_dir=str(tmp_path), train_steps=0)
    cfg = json.load(open(os.path.join(paths.target, "config.json")))
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert cfg["num_attention_heads"] % 8 == 0 and cfg["q_lora_rank"] is not None
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(paths.target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_tiny_target_distributions_are_not_degenerate(tmp_path):
    paths = write_tiny_models(cache_dir=str(tmp_path), train_steps=0)
    model = get_model(VllmConfig(model_config=ModelConfig(model=paths.target, dtype="float32", device="cpu")))
    ids = torch.tensor(list(b"The quick brown fox jumps over the lazy dog. 0123456789"))
    with torch.no_grad(), dense_attention_context():
        probs = model.compute_logits(model(ids, torch.arange(len(ids)))).softmax(-1)
    top = probs.max(-1).values
    assert 0.05 < top.mean() < 0.95          # neither uniform nor one-hot
    assert probs.argmax(-1).unique().numel() >= 5  # greedy choice depends on the context


def test_shipped_is_default_and_bad_arguments_are_named(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="seed=5.*train_steps=0"):
        write_tiny_models(cache_dir=str(tmp_path / "a"), seed=5)
    with pytest.raises(ValueError, match="train_steps must be None.*-1"):
        write_tiny_models(cache_dir=str(tmp_path / "b"), train_steps=-1)
    shipped = write_tiny_models(cache_dir=str(tmp_path / "c"))
    random = write_tiny_models(cache_dir=str(tmp_path / "c"), train_steps=0)  # same dir, other family
    assert shipped == random
    stamp = json.load(open(os.path.join(str(tmp_path / "c"), "tiny_models.json")))
    assert stamp["weights"] == "random" and stamp["format"] == 4


def _untrained_family(tmp_path):
    """(paths, configs, checkpoint weights, prompts) of the random-weights tiny family, the
    input of a short distillation."""
    from safetensors.torch import load_file

    from vllm.model_executor.models import tiny

    paths = write_tiny_models(cache_dir=str(tmp_path / "untrained"), train_steps=0)
    configs = tiny.tiny_family_configs(shipped=False)
    weights = {n: load_file(os.path.join(getattr(paths, n), "model.safetensors")) for n in configs}
    prompts = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(0))
    return paths, configs, weights, prompts


def test_distillation_runs_and_exports_loadable_weights(tmp_path):
    from vllm.config import SpeculativeConfig
    from vllm.model_executor.model_loader import get_draft_model
    from vllm.model_executor.models import tiny, tiny_distill

    report = {}
    paths, configs, weights, prompts = _untrained_family(tmp_path)
    out = tiny_distill.distill_drafters(configs, weights, train_steps=2, seed=0, report=report,
                                        prompts=prompts, num_new=12)
    assert set(report) == {"eagle", "mtp", "dflash", "dspark"}
    target = get_model(VllmConfig(model_config=ModelConfig(model=paths.target, dtype="float32", device="cpu")))
    for name in report:
        assert set(out[name]) == set(weights[name])
        assert all(out[name][k].shape == weights[name][k].shape for k in weights[name])
        changed = any(not torch.equal(out[name][k], weights[name][k]) for k in weights[name])
        assert changed == report[name]["kept"]
        assert 0.0 <= report[name]["accuracy_after"] <= 1.0
        d = str(tmp_path / name)
        tiny.write_checkpoint(d, configs[name][0], out[name])
        spec = SpeculativeConfig(method=name, model=d, num_speculative_tokens=2)
        draft = get_draft_model(VllmConfig(model_config=ModelConfig(model=paths.target, dtype="float32",
                                                                    device="cpu"), speculative_config=spec), target)
        loaded = dict(draft.named_parameters())
        assert loaded  # the distilled tensors load under the engine's own names


def test_distilling_a_subset_leaves_the_other_drafters_alone(tmp_path):
    from vllm.model_executor.models import tiny_distill

    report = {}
    _, configs, weights, prompts = _untrained_family(tmp_path)
    out = tiny_distill.distill_drafters(configs, weights, train_steps=2, seed=0, report=report,
                                        prompts=prompts, num_new=12, methods=("dspark",), batch=4)
    assert set(report) == {"dspark"}
    for name in ("eagle", "mtp", "dflash"):
        assert out[name] is weights[name]
    with pytest.raises(ValueError, match=r"methods=\('medusa',\).*choose one or more of"):
        tiny_distill.distill_drafters(configs, weights, train_steps=1, seed=0, methods=("medusa",))
