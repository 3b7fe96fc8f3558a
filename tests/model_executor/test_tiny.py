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


def test_row_decay_weighs_each_block_row_by_its_gamma(tmp_path):
    """block_loss(row_decay=gamma) is the mean over blocks of sum_j exp(-j/gamma) CE_j / sum_j
    exp(-j/gamma), CE_j computed here row by row in float64 from the same logits; a huge gamma
    is the unweighted loss; EAGLE / MTP and gamma <= 0 are refused."""
    import math

    from vllm.model_executor.models import tiny_distill, tiny_train as tt

    _, configs, weights, prompts = _untrained_family(tmp_path)
    target_p = {k: v.float() for k, v in weights["target"].items()}
    gen = torch.Generator().manual_seed(0)
    seqs = tiny_distill.generate_corpus(target_p, configs["target"][0], prompts, 24, gen)
    cfg = configs["dspark"][0]
    data = tiny_distill.target_features(target_p, configs["target"][0], seqs,
                                        cfg["target_layer_ids"])
    tables = tt.rope_tables(cfg, seqs.shape[1] + 16)
    p = {k: v.float() for k, v in weights["dspark"].items()}
    rows = torch.arange(seqs.shape[0])
    q = int(cfg["block_size"])
    anchors = torch.arange(1, seqs.shape[1] - q, q)[None, :].expand(len(rows), -1)  # fixed grid
    block = torch.full((len(rows), anchors.shape[1], q), int(cfg["mask_token_id"]))
    block[:, :, 0] = data["ids"].gather(1, anchors)
    with torch.no_grad():
        hidden = tt.block_drafter_forward(p, cfg, target_p, data["aux"], anchors, block, tables)
        logits = tt.lm_logits(target_p, hidden).double()
        pos = anchors[:, :, None] + torch.arange(q)
        gold = data["argmax"].gather(1, pos.flatten(1)).view_as(pos)
        prev = torch.cat([block[:, :, :1], gold[:, :, :-1]], dim=2)
        logits = logits + tt.markov_bias(p, prev).double()
        per_block = []
        for b in range(gold.shape[0]):
            for a in range(gold.shape[1]):
                ce = [float(torch.logsumexp(logits[b, a, j], 0) - logits[b, a, j, gold[b, a, j]])
                      for j in range(q)]
                per_block.append(ce)
    for gamma in (0.5, 2.0):
        w = [math.exp(-j / gamma) for j in range(q)]
        expected = sum(sum(wj * c for wj, c in zip(w, ce)) / sum(w)
                       for ce in per_block) / len(per_block)
        got, _, count = tiny_distill.block_loss("dspark", p, cfg, target_p, data, rows, tables,
                                                   gen, fixed=True, row_decay=gamma)
        assert float(got) == pytest.approx(expected, rel=1e-5)
        assert count == len(per_block) * q  # hits count every row alike
    flat = sum(sum(ce) for ce in per_block) / (len(per_block) * q)
    got, _, _ = tiny_distill.block_loss("dspark", p, cfg, target_p, data, rows, tables, gen,
                                        fixed=True, row_decay=1e12)
    assert float(got) == pytest.approx(flat, rel=1e-5)
    for method, gamma in (("eagle", 2.0), ("dspark", 0.0)):
        with pytest.raises(ValueError, match=rf"row_decay={gamma!r} for {method}"):
            tiny_distill.train_drafter(method, weights[method], configs[method][0], target_p, data,
                                       steps=1, gen=gen, row_decay=gamma)
