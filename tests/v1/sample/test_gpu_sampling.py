"""The sampler and rejection sampler on CUDA tensors with CUDA generators (H200 node)."""
import pytest
import torch

from tests.utils.stats_helpers import chi_square_p_value
from tests.utils.sampling import P_ROWS, Q_NONTRIVIAL, Params
from vllm.v1.sample.metadata import SamplingMetadata, make_generator
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler


@pytest.mark.gpu
def test_cuda_greedy_rejection_cases():
    logits = torch.zeros(5, 8, device="cuda")
    for row, token in enumerate([1, 2, 3, 5, 0]):
        logits[row, token] = 5.0
    md = SamplingMetadata.from_sampling_params([Params(0.0)] * 2, "cuda")
    out = RejectionSampler()(logits, [[1, 2], [4]], md)
    assert out.sampled_token_ids == [[1, 2, 3], [5]]


@pytest.mark.gpu
def test_cuda_probabilistic_rejection_follows_target():
    n = 30000
    gen = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(q, n, replacement=True, generator=gen)
                          for q in Q_NONTRIVIAL], dim=1)
    logits = torch.log(P_ROWS).repeat(n, 1).float().cuda()
    draft_probs = Q_NONTRIVIAL.repeat(n, 1).float().cuda()
    md = SamplingMetadata.from_sampling_params([Params(1.0)] * n, "cuda")
    torch.cuda.manual_seed(3)
    out = RejectionSampler("probabilistic")(logits, drafts.tolist(), md, draft_probs)
    first = torch.tensor([s[0] for s in out.sampled_token_ids])
    assert chi_square_p_value(torch.bincount(first, minlength=5), P_ROWS[0]) > 1e-3


@pytest.mark.gpu
def test_cuda_seeded_sampling_is_reproducible():
    logits = torch.randn(4, 1000, device="cuda")
    params = [Params(1.0, seed=5)] * 4

    def run():
        gens = {i: make_generator(100 + i, "cuda") for i in range(4)}
        md = SamplingMetadata.from_sampling_params(params, "cuda", gens)
        return [Sampler()(logits, md).tolist() for _ in range(3)]

    assert run() == run()
