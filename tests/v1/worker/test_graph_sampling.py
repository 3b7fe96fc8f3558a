"""The greedy step captured with the forward (graph_sampling.py) equals the eager path: the
device rejection sampler (k > 0) or the sampler's argmax (k = 0), for the real rows of padded
uniform batches; padding rows write only the scratch entry of last_sampled."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.worker.gpu.graph_sampling import captured_greedy_step


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [0, 1, 4])
def test_captured_greedy_step_equals_eager_verification(seed, k):
    gen = torch.Generator().manual_seed(seed)
    max_reqs, vocab, q = 16, 37, k + 1
    real = int(torch.randint(1, 8, (1,), generator=gen))
    padded = real + int(torch.randint(0, 4, (1,), generator=gen))
    slots = torch.randperm(max_reqs, generator=gen)[:real]
    slots_padded = torch.cat([slots, torch.zeros(padded - real, dtype=torch.int64)])
    logits = torch.randn(padded * q, vocab, generator=gen)
    greedy = logits.argmax(-1).view(padded, q)
    draft_tokens = torch.randint(0, vocab, (max_reqs, max(k, 1)), generator=gen)
    # Make some drafts right so that acceptance prefixes of every length occur.
    for i in range(real):
        n_right = int(torch.randint(0, k + 1, (1,), generator=gen))
        draft_tokens[slots[i], :n_right] = greedy[i, :n_right]
    qsl = torch.tensor([min(i, real) * q for i in range(padded + 1)])
    last_sampled = torch.full((max_reqs + 1,), -3, dtype=torch.int64)
    out = torch.full((max_reqs, k + 2), -9, dtype=torch.int64)
    captured_greedy_step(logits, padded, q, slots_padded, qsl, draft_tokens, last_sampled,
                         max_reqs, out)

    # Eager oracle over the real rows only.
    md = SamplingMetadata(temperature=torch.zeros(real), all_greedy=True, all_random=False)
    real_logits = logits[: real * q]
    if k == 0:
        want_tokens = [[int(t)] for t in real_logits.argmax(-1)]
    else:
        drafts = draft_tokens[slots, :k].reshape(-1)
        result = RejectionSampler("strict").verify(real_logits, drafts,
                                                   np.full(real, k, dtype=np.int64), md)
        want_tokens = [result.sampled[i, : int(result.num_sampled[i])].tolist()
                       for i in range(real)]
    for i in range(real):
        n = int(out[i, -1])
        assert out[i, :n].tolist() == want_tokens[i]
        assert int(last_sampled[slots[i]]) == want_tokens[i][-1]
    untouched = torch.ones(max_reqs + 1, dtype=torch.bool)
    untouched[slots] = False
    untouched[max_reqs] = False  # scratch: padding rows' writes land here
    assert (last_sampled[untouched] == -3).all()
