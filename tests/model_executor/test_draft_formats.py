"""Draft checkpoints in the layouts upstream drafters ship, MTP from inside the target, and the
speculative-config defaults they imply (method inferred, k from the block / next-n layers, an
oversized k refused naming both numbers). End-to-end runs use the built-in tiny model on CPU;
the oracle is plain greedy decoding of the same target."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm import LLM, SamplingParams
from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.model_executor.models.drafter_common import block_drafter_fields
from vllm.model_executor.models.tiny import write_tiny_models
from vllm.transformers_utils.config import HFConfig

PROMPTS = [[5, 17, 29, 41, 53, 65, 77, 89], [200, 3, 99, 12], [7, 7, 7, 30, 31]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _read(path):
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _copy_with_config(src, dst, config):
    os.makedirs(dst, exist_ok=True)
    for entry in os.listdir(src):
        if entry != "config.json" and os.path.isfile(os.path.join(src, entry)):
            shutil.copyfile(os.path.join(src, entry), os.path.join(dst, entry))
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


def dflash_upstream_layout(config: dict) -> dict:
    """z-lab layout: top-level block_size, nested dflash_config."""
    c = {k: v for k, v in config.items() if k not in ("target_layer_ids", "mask_token_id")}
    c["dflash_config"] = {"target_layer_ids": config["target_layer_ids"], "mask_token_id": config["mask_token_id"]}
    return c


def dspark_prefixed_layout(config: dict) -> dict:
    c = {k: v for k, v in config.items() if k not in ("target_layer_ids", "block_size", "mask_token_id")}
    c.update(dspark_target_layer_ids=config["target_layer_ids"], dspark_block_size=config["block_size"],
             dspark_noise_token_id=config["mask_token_id"], markov_head_type="low_rank")
    return c


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    with LLM(model=tiny.target, device="cpu", max_model_len=128) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _spec_run(target, spec):
    with LLM(model=target, device="cpu", max_model_len=128, speculative_config=spec) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        resolved = llm.llm_engine.vllm_config.speculative_config
        return outs, llm.llm_engine.get_metrics()["spec_decode"], resolved


def test_block_drafter_fields_read_every_layout(tiny):
    base = _read(tiny.dspark)
    want = (tuple(base["target_layer_ids"]), base["block_size"], base["mask_token_id"])
    for method, layout in [("dflash", dflash_upstream_layout), ("dspark", dspark_prefixed_layout),
                           ("dspark", lambda c: c)]:
        f = block_drafter_fields(HFConfig(layout(dict(base))), method)
        assert (f.target_layer_ids, f.block_size, f.mask_token_id) == want
    f = block_drafter_fields(HFConfig(dspark_prefixed_layout(dict(base))), "dspark")
    assert (f.markov_rank, f.markov_head_type) == (base["markov_rank"], "low_rank")
    clash = dict(dspark_prefixed_layout(dict(base)), block_size=base["block_size"] + 1)
    with pytest.raises(ValueError, match=r"dspark_block_size=4 and block_size=5"):
        block_drafter_fields(HFConfig(clash), "dspark")
    with pytest.raises(ValueError, match=r"markov_head_type='mlp' is not supported"):
        block_drafter_fields(HFConfig(dict(base, markov_head_type="mlp")), "dspark")
    no_layers = {k: v for k, v in dflash_upstream_layout(dict(base)).items() if k != "dflash_config"}
    with pytest.raises(ValueError, match=r"lacks \['target_layer_ids', 'mask_token_id'\]"):
        block_drafter_fields(HFConfig(no_layers), "dflash")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dflash_nested", "dspark_prefixed"])
def test_upstream_layouts_load_and_keep_greedy_exact(tiny, tmp_path, plain_greedy, layout):
    if layout == "dflash_nested":
        draft = _copy_with_config(tiny.dflash, str(tmp_path / "d"), dflash_upstream_layout(_read(tiny.dflash)))
        method, k = "dflash", _read(tiny.dflash)["block_size"] - 1
    else:
        draft = _copy_with_config(tiny.dspark, str(tmp_path / "d"), dspark_prefixed_layout(_read(tiny.dspark)))
        method, k = "dspark", _read(tiny.dspark)["block_size"]
    # no method, no k: both come from the draft config
    outs, metrics, resolved = _spec_run(tiny.target, {"model": draft})
    assert (resolved.method, resolved.num_speculative_tokens) == (method, k)
    assert outs == plain_greedy
    assert metrics["num_drafts"] > 0


def test_oversized_k_refused_naming_both(tiny):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=8 does not fit the dspark drafter's "
                                         r"block_size=4 .*at most block_size = 4"):
        VllmConfig(model_config=ModelConfig(model=tiny.target, device="cpu"),
                   speculative_config=SpeculativeConfig(method="dspark", model=tiny.dspark,
                                                        num_speculative_tokens=8))
    # The built-in DFlash block is 5 tokens (anchor + 4 masks): k = 5 is one too many.
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 does not fit the dflash drafter's "
                                         r"block_size=5 .*= 4"):
        VllmConfig(model_config=ModelConfig(model=tiny.target, device="cpu"),
                   speculative_config={"method": "dflash", "model": tiny.dflash, "num_speculative_tokens": 5})


def test_method_inferred_and_eagle_needs_k(tiny):
    for name, method in [("dflash", "dflash"), ("dspark", "dspark"), ("mtp", "mtp"), ("eagle", "eagle")]:
        spec = SpeculativeConfig(model=getattr(tiny, name), num_speculative_tokens=1)
        VllmConfig(model_config=ModelConfig(model=tiny.target, device="cpu"), speculative_config=spec)
        assert spec.method == method
    with pytest.raises(ValueError, match="'eagle' needs num_speculative_tokens"):
        VllmConfig(model_config=ModelConfig(model=tiny.target, device="cpu"),
                   speculative_config=SpeculativeConfig(model=tiny.eagle))


def test_mtp_without_model_on_target_without_nextn_refused(tiny):
    with pytest.raises(ValueError, match=r"without a model uses the target's own next-n layers, but "
                                         r".*num_nextn_predict_layers=0"):
        VllmConfig(model_config=ModelConfig(model=tiny.target, device="cpu"),
                   speculative_config={"method": "deepseek_mtp"})


def write_target_with_mtp(tiny, dst, corrupt: bool = False) -> str:
    """DeepSeek-V3 layout: the tiny target's tensors plus the tiny MTP drafter's layer
    model.layers.{num_hidden_layers}.* in ONE checkpoint, config num_nextn_predict_layers=1."""
    tensors = load_file(os.path.join(tiny.target, "model.safetensors"))
    mtp = load_file(os.path.join(tiny.mtp, "model.safetensors"))
    if corrupt:
        gen = torch.Generator().manual_seed(0)
        mtp = {k: (torch.randn(v.shape, generator=gen) / v.shape[-1] ** 0.5 if k.endswith("eh_proj.weight") else v)
               for k, v in mtp.items()}
    n = _read(tiny.target)["num_hidden_layers"]
    assert mtp and all(k.startswith(f"model.layers.{n}.") for k in mtp)
    tensors.update(mtp)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    config = dict(_read(tiny.target), num_nextn_predict_layers=1)
    for entry in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tiny.target, entry), os.path.join(dst, entry))
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


@pytest.mark.slow
def test_mtp_from_target_checkpoint(tiny, tmp_path, plain_greedy):
    target = write_target_with_mtp(tiny, str(tmp_path / "v3_mtp"))
    outs, metrics, resolved = _spec_run(target, {"method": "mtp"})
    assert resolved.model == target and resolved.num_speculative_tokens == 1  # = num_nextn_predict_layers
    assert outs == plain_greedy  # the MTP layer in the checkpoint does not change the target
    assert metrics["num_accepted_tokens"] > 0
    # the run really drafts with the checkpoint's own layer: corrupting it changes acceptance
    bad = write_target_with_mtp(tiny, str(tmp_path / "v3_mtp_bad"), corrupt=True)
    bad_outs, bad_metrics, _ = _spec_run(bad, {"method": "deepseek_mtp"})
    assert bad_outs == plain_greedy
    assert bad_metrics["num_drafts"] > 0
    assert bad_metrics["num_accepted_tokens"] != metrics["num_accepted_tokens"]
    assert bad_metrics["num_accepted_tokens"] < metrics["num_accepted_tokens"]
