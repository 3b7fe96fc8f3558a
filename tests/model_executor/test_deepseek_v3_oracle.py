"""Our DeepseekV3ForCausalLM vs Hugging Face transformers on the same random checkpoints
(float32): whole-prompt prefill, and step-by-step prefill + decode through the paged MLA cache
(TORCH_MLA, absorbed decode, mixed decode/prefill batches, multi-token causal decode chunks)."""
import pytest
import torch

from tests.utils.paged_harness import PagedRequest, PagedRunner, hf_logits
from vllm.model_executor.model_loader import iterate_safetensors
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.tiny import write_random_target, yarn_rope_scaling
from vllm.transformers_utils.config import HFConfig, load_hf_config
from vllm.forward_context import dense_attention_context

VARIANTS = {
    # q_lora set, layer 0 dense then sigmoid/noaux MoE, plain RoPE (interleaved)
    "qlora_moe": dict(),
    # q_lora None, every layer dense, YaRN with mscale != mscale_all_dim
    "noqlora_dense_yarn": dict(q_lora_rank=None, first_k_dense_replace=3,
                               rope_scaling=yarn_rope_scaling(factor=4.0, mscale=0.9, mscale_all_dim=1.1)),
    # grouped routing (2 groups, best 1), YaRN, NeoX-style rotary
    "grouped_moe_yarn_neox": dict(n_group=2, topk_group=1, rope_interleave=False,
                                  rope_scaling=yarn_rope_scaling(factor=8.0, original_max_position_embeddings=512)),
}

PROMPT_A = [(7 * i * i + 3 * i + 11) % 256 for i in range(22)]
PROMPT_B = [(5 * i + 101) % 256 for i in range(13)]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert rel <= 1e-4, f"max abs diff relative to logit scale = {rel:.2e}"


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp(request.param))
    write_random_target(model_dir, seed=3, **VARIANTS[request.param])
    model = DeepseekV3ForCausalLM(hf_config=load_hf_config(model_dir), prefix="")
    model.load_weights(iterate_safetensors(model_dir))
    return request.param, model_dir, model.eval(), hf_logits(model_dir, PROMPT_A), hf_logits(model_dir, PROMPT_B)


def test_prefill_matches_hf(variant):
    _, _, model, ref_a, _ = variant
    with torch.no_grad(), dense_attention_context():
        ours = model.compute_logits(model(torch.tensor(PROMPT_A), torch.arange(len(PROMPT_A))))
    assert_logits_close(ours, ref_a)


def test_paged_prefill_and_decode_match_hf(variant):
    _, _, model, ref_a, ref_b = variant
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    # A: prefill 8, then single-token and multi-token decode chunks. B joins at step 2, so steps
    # mix A's decode rows with B's prefill rows (decodes first), then both decode together.
    req_a = PagedRequest(PROMPT_A, chunks=[8, 1, 1, 3, 1, 2, 1, 5])
    req_b = PagedRequest(PROMPT_B, chunks=[5, 1, 4, 1, 2], start_step=2)
    logits_a, logits_b = runner.run([req_a, req_b])
    assert_logits_close(logits_a, ref_a)
    assert_logits_close(logits_b, ref_b)


@pytest.mark.parametrize("name", [n for n in sorted(VARIANTS) if "yarn" in n])
def test_yarn_changes_logits(name, tmp_path):
    """Guards the YaRN comparisons above: the same weights without the scaling give other logits."""
    model_dir = str(tmp_path)
    write_random_target(model_dir, seed=3, **VARIANTS[name])
    ref_a = hf_logits(model_dir, PROMPT_A)
    values = load_hf_config(model_dir).to_dict()
    values["rope_scaling"] = None
    plain = DeepseekV3ForCausalLM(hf_config=HFConfig(values))
    plain.load_weights(iterate_safetensors(model_dir))
    with torch.no_grad(), dense_attention_context():
        ours = plain.compute_logits(plain(torch.tensor(PROMPT_A), torch.arange(len(PROMPT_A))))
    assert (ours - ref_a).abs().max().item() > 1e-2
