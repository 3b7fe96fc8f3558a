"""DeepseekV2ForCausalLM vs Hugging Face transformers' DeepseekV2ForCausalLM on tiny random V2
checkpoints (float32, same tolerance as the V3 oracle): softmax greedy routing without a
correction bias, q_lora on/off, YaRN; plus the registry (architectures / model_type) and refusals."""
import pytest
import torch

from vllm.forward_context import dense_attention_context
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
from vllm.model_executor.models.registry import resolve_model_cls
from vllm.model_executor.models.tiny import write_random_target, yarn_rope_scaling

PROMPT = [(7 * i * i + 3 * i + 11) % 256 for i in range(22)]
V2 = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", scoring_func="softmax",
          topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1)
VARIANTS = {
    "lite_greedy": dict(q_lora_rank=None, routed_scaling_factor=1.0),
    "qlora_scaled": dict(routed_scaling_factor=2.5, n_routed_experts=6, num_experts_per_tok=3),
    "yarn": dict(rope_scaling=yarn_rope_scaling(factor=4.0, mscale=0.707, mscale_all_dim=0.707)),
}


def hf_v2_logits(model_dir, ids):
    import transformers
    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_v2_logits_match_transformers(tmp_path, variant):
    model_dir = write_random_target(str(tmp_path), seed=9, **{**V2, **VARIANTS[variant]})
    model = get_model(VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float32", device="cpu",
                                                          attention_backend="TORCH_MLA")))
    assert isinstance(model, DeepseekV2ForCausalLM)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias is None
    with torch.no_grad(), dense_attention_context():
        ours = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))
    ref = hf_v2_logits(model_dir, PROMPT)
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert rel <= 1e-4, f"max abs diff relative to logit scale = {rel:.2e}"


def test_registry_and_refusals(tmp_path):
    assert resolve_model_cls(["DeepseekV2ForCausalLM"]) is DeepseekV2ForCausalLM
    assert resolve_model_cls([], model_type="deepseek_v2") is DeepseekV2ForCausalLM
    assert resolve_model_cls(["KimiK2ForCausalLM"], model_type="kimi_k2").__name__ == "DeepseekV3ForCausalLM"
    bad = write_random_target(str(tmp_path / "g"), seed=1, **{**V2, "topk_method": "group_limited_greedy",
                                                                "n_group": 2, "topk_group": 1})
    with pytest.raises(ValueError, match="group_limited_greedy with n_group=2, topk_group=1 needs group-max"):
        get_model(VllmConfig(model_config=ModelConfig(model=bad, dtype="float32", device="cpu")))
    sig = write_random_target(str(tmp_path / "s"), seed=1, **{**V2, "scoring_func": "sigmoid"})
    with pytest.raises(ValueError, match="scoring_func 'softmax', got 'sigmoid'"):
        get_model(VllmConfig(model_config=ModelConfig(model=sig, dtype="float32", device="cpu")))
