"""--load-format dummy and the shipped benchmark configs (benchmarks/configs): shapes at the real
DeepSeek-V3 per-TP8-rank dims checked on never-touched (unallocated) parameters, fp8 weight bytes,
seeded dummy weights that keep activations finite through many layers, a real-dims forward of a
reduced layer count, and dummy target + drafter through the engine."""
import json
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.forward_context import dense_attention_context
from vllm.config import LoadConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.fp8_utils import FP8_DTYPE
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.dummy import fill_dummy_weights
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.dspark_mla import DSparkMLAForCausalLM
from vllm.model_executor.models.tiny import tiny_dspark_config, tiny_target_config, write_byte_tokenizer
from vllm.transformers_utils.config import HFConfig, load_hf_config
from vllm.transformers_utils.tokenizer import get_tokenizer

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
DENSE, MOE, DSPARK = (str(CONFIGS / n) for n in ("deepseek_v3_tp8_rank", "deepseek_v3_tp8_rank_moe",
                                                 "deepseek_v3_tp8_rank_dspark"))


def expected_num_params(c: dict) -> int:
    """Brute-force parameter count of a DeepSeek-V3 config (independent of the model code)."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (c["q_lora_rank"] * d + c["q_lora_rank"] + h * qk * c["q_lora_rank"]
            + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * d + c["kv_lora_rank"]
            + h * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"] + d * h * c["v_head_dim"])
    total = 2 * c["vocab_size"] * d + d  # embed + lm_head + final norm
    for i in range(c["num_hidden_layers"]):
        total += attn + 2 * d
        if c.get("n_routed_experts") and i >= c["first_k_dense_replace"]:
            e, mi = c["n_routed_experts"], c["moe_intermediate_size"]
            total += e * d + e + e * 3 * d * mi + 3 * d * mi * c["n_shared_experts"]
        else:
            total += 3 * d * c["intermediate_size"]
    return total


def _meta_model(model_dir):
    """Built with torch.empty parameters that are never written: the pages are never touched, so
    even the 6 GB MoE config costs little resident memory. (The meta device cannot be used: the
    rotary tables are computed at construction.)"""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return DeepseekV3ForCausalLM(hf_config=load_hf_config(model_dir))
    finally:
        torch.set_default_dtype(prev)


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("model_dir", [DENSE, MOE])
def test_benchmark_config_shapes_on_meta(model_dir):
    c = json.loads(Path(model_dir, "config.json").read_text())
    assert (c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]) == (7168, 16, 1536, 512)
    assert c["vocab_size"] == 129280 // 8 and c["max_position_embeddings"] >= 128 * 1024
    assert c["rope_scaling"]["type"] == "yarn"
    model = _meta_model(model_dir)
    assert sum(p.numel() for p in model.parameters()) == expected_num_params(c)
    layer = model.model.layers[0].self_attn
    assert tuple(layer.q_b_proj.weight.shape) == (16 * 192, 1536)
    assert tuple(model.model.layers[0].mlp.gate_up_proj.weight.shape) == (2 * 2304, 7168)
    if c.get("n_routed_experts"):
        moe = model.model.layers[-1].mlp
        assert moe.experts.num_experts == 256 and moe.top_k == 8 and (moe.num_groups, moe.topk_groups) == (8, 4)
        assert tuple(moe.experts.w2_weight.shape) == (256, 7168, 256)  # [experts, hidden, 2048 / TP8]
    # fp8: every dense projection becomes 1 byte/elem + float32 128x128 block scales
    bf16_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    Fp8Config().apply_to(model, None)
    assert layer.q_b_proj.weight.dtype == FP8_DTYPE and tuple(layer.q_b_proj.weight_scale_inv.shape) == (24, 12)
    assert tuple(layer.kv_a_proj_with_mqa.weight_scale_inv.shape) == (5, 56)  # 576 rows: a partial block
    if not c.get("n_routed_experts"):
        fp8_bytes = sum(p.numel() * (1 if p.dtype == FP8_DTYPE else (4 if "scale" in n else 2))
                        for n, p in model.named_parameters())
        linear = bf16_bytes - 2 * 2 * c["vocab_size"] * 7168  # embed + lm_head stay bf16
        assert fp8_bytes - 2 * 2 * c["vocab_size"] * 7168 < 0.52 * linear


def test_dspark_benchmark_config_fits_the_targets():
    cfg = load_hf_config(DSPARK)
    draft = DSparkMLAForCausalLM(hf_config=cfg)
    assert draft.target_layer_ids == (1, 4, 7) and draft.block_size == 4 and draft.mask_token_id == 259
    for target in (DENSE, MOE):
        draft.check_target_fit(load_hf_config(target))
    tok = get_tokenizer(DSPARK)
    assert len(tok) <= cfg.vocab_size and tok.convert_ids_to_tokens([259]) == ["<|mask|>"]
    assert get_tokenizer(DENSE).eos_token_id == load_hf_config(DENSE).eos_token_id


def test_real_dims_dummy_forward_reduced_layers():
    """Two layers of the V3-rank dense config at real dims, bf16 and fp8 (dequantised on CPU)."""
    values = load_hf_config(DENSE).to_dict()
    values["num_hidden_layers"] = 2
    ids = torch.arange(1, 9)
    for quant in (None, Fp8Config()):
        with torch.device("cpu"):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = DeepseekV3ForCausalLM(hf_config=HFConfig(dict(values))).eval()
            finally:
                torch.set_default_dtype(prev)
        if quant is not None:
            quant.apply_to(model, None)
        fill_dummy_weights(model, seed=0)
        with torch.no_grad(), dense_attention_context():
            logits = model.compute_logits(model(ids, torch.arange(8))).float()
        assert torch.isfinite(logits).all()
        assert 0.1 < logits.std().item() < 10.0
        del model


def test_dummy_weights_stay_finite_through_many_layers_and_are_seeded():
    config = HFConfig(tiny_target_config(num_hidden_layers=32, first_k_dense_replace=16))
    models = []
    for seed in (0, 0, 1):
        model = DeepseekV3ForCausalLM(hf_config=config).eval()
        fill_dummy_weights(model, seed=seed)
        models.append(model)
    ids = torch.tensor([5, 17, 29, 41, 53, 65])
    with torch.no_grad(), dense_attention_context():
        hidden = [m.model(ids, torch.arange(6))[0] for m in models]
    assert torch.isfinite(hidden[0]).all() and hidden[0].abs().max() < 1e3
    assert torch.equal(hidden[0], hidden[1]) and not torch.equal(hidden[0], hidden[2])
    norms = [p for n, p in models[0].named_parameters() if n.endswith("layernorm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)


@pytest.mark.slow
def test_engine_with_dummy_target_and_drafter(tmp_path):
    """A config-only target and DSpark drafter (no safetensors) run; greedy with the dummy drafter
    equals plain greedy of the dummy target (same seed)."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    for d, cfg in ((target, tiny_target_config()), (draft, tiny_dspark_config(tiny_target_config()))):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        write_byte_tokenizer(str(d))
    assert not list(target.glob("*.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    common = dict(device="cpu", max_model_len=128, load_format="dummy")
    with LLM(model=str(target), **common) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [100, 3]], params, use_tqdm=False)]
    with LLM(model=str(target), speculative_config={"model": str(draft)}, **common) as llm:
        spec = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [100, 3]], params, use_tqdm=False)]
        assert llm.llm_engine.get_metrics()["spec_decode"]["num_drafts"] > 0
    assert spec == plain
    with pytest.raises(ValueError, match="no \\*.safetensors weights .*--load-format dummy"):
        get_model(VllmConfig(model_config=ModelConfig(model=str(target), device="cpu"),
                             load_config=LoadConfig("auto")))


def test_fp8_dummy_weights_are_the_quantised_float_ones():
    from vllm.model_executor.layers.quantization.fp8_utils import block_dequantize, block_quantize
    config = HFConfig(tiny_target_config(num_hidden_layers=2))
    plain, quant = DeepseekV3ForCausalLM(hf_config=config), DeepseekV3ForCausalLM(hf_config=config)
    Fp8Config().apply_to(quant, None)
    fill_dummy_weights(plain, seed=3)
    fill_dummy_weights(quant, seed=3)
    w = plain.model.layers[0].self_attn.o_proj.weight
    layer = quant.model.layers[0].self_attn.o_proj
    assert layer.weight.dtype == FP8_DTYPE
    expected = block_dequantize(*block_quantize(w, (128, 128)), (128, 128))
    torch.testing.assert_close(layer.quant_method.dequantized_weight(layer, torch.float32), expected, rtol=0, atol=0)
