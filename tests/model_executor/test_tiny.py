"""The built-in tiny model family: written once from a seed, loadable by Hugging Face with no
missing/unexpected keys, and with non-degenerate next-token distributions."""
import json
import os

import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.forward_context import dense_attention_context


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


def test_paged_greedy_decode_equals_recompute_greedy(tmp_path):
    """The distillation corpus is decoded through the paged cache; it must equal plain greedy
    decoding by full recomputation."""
    from vllm.model_executor.models.tiny_distill import _greedy_decode
    paths = write_tiny_models(cache_dir=str(tmp_path), train_steps=0)
    model = get_model(VllmConfig(model_config=ModelConfig(model=paths.target, dtype="float32", device="cpu",
                                                          attention_backend="TORCH_MLA")))
    prompts = [[1, 2, 3], [200, 100, 50, 25, 12], [65]]
    paged = _greedy_decode(model, prompts, 6)
    for prompt, got in zip(prompts, paged):
        ids = list(prompt)
        with torch.no_grad(), dense_attention_context():
            for _ in range(6):
                ids.append(int(model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))[-1].argmax()))
        assert got == ids


def test_distillation_runs_and_exports_loadable_weights(tmp_path, monkeypatch):
    from vllm.model_executor.models import tiny_distill
    monkeypatch.setattr(tiny_distill, "_NUM_SEQS", 4)
    monkeypatch.setattr(tiny_distill, "_GEN_LEN", 12)
    report = {}
    paths = write_tiny_models(cache_dir=str(tmp_path / "untrained"), train_steps=0)
    from vllm.model_executor.models import tiny
    target_cfg = tiny.tiny_target_config()
    configs = {"target": (target_cfg, None), "eagle": (tiny.tiny_eagle_config(target_cfg), None),
               "mtp": (tiny.tiny_mtp_config(target_cfg), None), "dflash": (tiny.tiny_dflash_config(target_cfg), None),
               "dspark": (tiny.tiny_dspark_config(target_cfg), None)}
    from safetensors.torch import load_file
    weights = {n: load_file(os.path.join(getattr(paths, n), "model.safetensors")) for n in configs}
    out = tiny_distill.distill_drafters(configs, weights, train_steps=2, seed=0, report=report)
    assert set(report) == {"eagle", "mtp", "dflash", "dspark"}
    for name in report:
        assert set(out[name]) == set(weights[name])
        assert all(out[name][k].shape == weights[name][k].shape for k in weights[name])
        changed = any(not torch.equal(out[name][k], weights[name][k]) for k in weights[name])
        assert changed == report[name]["kept"]
