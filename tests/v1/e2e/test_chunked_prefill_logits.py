"""Chunked prefill logits through the paged MLA cache equal whole-prompt prefill logits and the
Hugging Face transformers oracle, for prompts that cross chunk boundaries (1, 15, 16, 17, 999
and 3000 tokens) at per-step budgets of 16, 64 and 1000 tokens (CPU, TORCH_MLA, float32).

Every chunk after the first is a prefill row with cached context, read back from the paged
latent cache in passes of 256 tokens (several passes for the long prompts), merged by LSE.
"""
import pytest
import torch

from tests.utils.paged_harness import PagedRequest, PagedRunner, hf_logits
from vllm.model_executor.model_loader import iterate_safetensors
from vllm.model_executor.models.deepseek_v3 import DeepseekV3ForCausalLM
from vllm.model_executor.models.tiny import write_random_target, yarn_rope_scaling
from vllm.transformers_utils.config import load_hf_config

pytestmark = pytest.mark.slow

LENGTHS = (1, 15, 16, 17, 999, 3000)
BLOCK = 16


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * i * i + 3 * i + salt) % 250 + 4 for i in range(n)]


PROMPTS = [prompt(n, salt=n) for n in LENGTHS]


@pytest.fixture(scope="module")
def model_and_oracle(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("yarn_target"))
    write_random_target(model_dir, seed=5, rope_scaling=yarn_rope_scaling(
        factor=4.0, original_max_position_embeddings=1024))
    model = DeepseekV3ForCausalLM(hf_config=load_hf_config(model_dir), prefix="")
    model.load_weights(iterate_safetensors(model_dir))
    return model.eval(), [hf_logits(model_dir, p) for p in PROMPTS]


def run_chunked(model, budget: int) -> list[torch.Tensor]:
    blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    runner = PagedRunner(model, block_size=BLOCK, num_blocks=blocks, context_chunk_tokens=256)
    requests = [PagedRequest(p, chunks=[budget] * (len(p) // budget)
                             + ([len(p) % budget] if len(p) % budget else []))
                for p in PROMPTS]
    return runner.run(requests)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    return (ours - ref).abs().max().item() / ref.abs().max().item()


@pytest.fixture(scope="module")
def whole(model_and_oracle):
    return run_chunked(model_and_oracle[0], budget=max(LENGTHS))


def test_whole_prompt_prefill_matches_hf(model_and_oracle, whole):
    for n, ours, ref in zip(LENGTHS, whole, model_and_oracle[1]):
        assert relative_error(ours, ref) <= 1e-4, f"{n}-token prompt"


@pytest.mark.parametrize("budget", [16, 64, 1000])
def test_chunked_prefill_logits_equal_whole_prompt_and_hf(model_and_oracle, whole, budget):
    model, oracle = model_and_oracle
    chunked = run_chunked(model, budget)
    for n, ours, unchunked, ref in zip(LENGTHS, chunked, whole, oracle):
        # every position's logits (the sampled last one included), not only the last
        assert relative_error(ours, unchunked) <= 2e-5, f"{n}-token prompt, budget {budget}"
        assert relative_error(ours, ref) <= 1e-4, f"{n}-token prompt, budget {budget}"
