"""End to end, speculative sampling must not change what is sampled: with sampled drafts
(draft_sample_method="probabilistic") verified by standard rejection sampling, the second generated
token of many seeded requests follows the target's exact conditional distribution p(t2 | prompt, t1).

Token 1 comes from the prefill; token 2 is the first one decided by verification (an accepted
draft, or a resample from the residual max(p - q, 0)), so it checks the whole path: the drafter's
q, the runner's bookkeeping of q, and the rejection sampler. Samples are grouped by their first
token and each group is compared with its own conditional (a chi-square summed over groups), which
is far more sensitive than the marginal. The oracle is Hugging Face transformers on the same tiny
checkpoint (float32, no cache). With 3000 requests the test rejects (p < 1e-17) both an acceptance
rule of min(1, 2p/q) and a resample from p instead of the residual, for DSpark and EAGLE alike.
"""
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.models.tiny import write_tiny_models

PROMPT = [5, 17, 29, 41]
NUM_REQUESTS = 3000
MIN_EXPECTED = 5.0  # chi-square needs >= 5 expected counts per cell; rarer tokens are pooled


@pytest.fixture(scope="module")
def tiny():
    return write_tiny_models()


@pytest.fixture(scope="module")
def second_token_conditionals(tiny):
    """[V(t1), V(t2)] float64: p(t2 | prompt, t1) for every first token t1."""
    import transformers
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    with torch.no_grad():
        vocab = model.config.vocab_size
        batch = torch.cat([torch.tensor(PROMPT).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        return torch.softmax(model(batch).logits[:, -1].double(), dim=-1)


def grouped_chi_square_p_value(first: torch.Tensor, second: torch.Tensor,
                               conditionals: torch.Tensor) -> float:
    """Goodness of fit of t2 to p(t2 | t1) within every t1 group, summed over the groups.
    Cells expected below MIN_EXPECTED are pooled per group (one 'other' cell)."""
    stat, df = torch.zeros((), dtype=torch.float64), 0
    for t1 in first.unique():
        in_group = second[first == t1]
        counts = torch.bincount(in_group, minlength=conditionals.shape[1]).double()
        expected = conditionals[int(t1)] * in_group.numel()
        big = expected >= MIN_EXPECTED
        observed = torch.cat([counts[big], counts[~big].sum().view(1)])
        expected = torch.cat([expected[big], expected[~big].sum().view(1)])
        if observed.numel() < 2:
            continue  # a group too small to say anything
        stat = stat + ((observed - expected) ** 2 / expected).sum()
        df += observed.numel() - 1
    assert df > 0, "no group was large enough for a chi-square test"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dspark", "eagle"])
def test_sampled_drafts_keep_the_target_distribution(tiny, second_token_conditionals, method):
    spec = {"method": method, "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic", "rejection_sample_method": "probabilistic"}
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=seed)
              for seed in range(NUM_REQUESTS)]
    with LLM(device="cpu", max_model_len=64, max_num_seqs=64, speculative_config=spec) as llm:
        outputs = llm.generate([PROMPT] * NUM_REQUESTS, params, use_tqdm=False)
        spec_stats = llm.llm_engine.get_metrics()["spec_decode"]
    tokens = torch.tensor([o.outputs[0].token_ids[:2] for o in outputs])
    first, second = tokens[:, 0], tokens[:, 1]

    # The drafts really took part: some were accepted, so token 2 is not just the target's sample.
    assert spec_stats["num_accepted_tokens"] > 0
    p_value = grouped_chi_square_p_value(first, second, second_token_conditionals)
    assert p_value > 1e-3, f"{method}: second tokens do not follow the target (p={p_value:.2e})"
    # Teeth: the same samples are rejected against a plausible wrong answer (every group
    # compared with the conditional of the most frequent first token).
    mode = int(first.mode().values)
    wrong = second_token_conditionals[mode].expand_as(second_token_conditionals)
    assert grouped_chi_square_p_value(first, second, wrong) < 1e-6
