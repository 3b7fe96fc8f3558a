import pytest
import torch

from vllm.v1.sample.metadata import SamplingMetadata, make_generator
from vllm.v1.sample.rejection_sampler import RejectionSampler

from tests.utils.stats_helpers import chi_square_p_value
from tests.utils.sampling import P_ROWS, Q_NONTRIVIAL, Params

NEG = float("-inf")


def one_hot_logits(token_ids, vocab=8):
    logits = torch.zeros(len(token_ids), vocab)
    for row, token in enumerate(token_ids):
        logits[row, token] = 5.0
    return logits


def greedy_md(n):
    return SamplingMetadata.from_sampling_params([Params(0.0)] * n, "cpu")


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_greedy_prefix_match_cases_by_hand(method):
    # Request A: drafts [1, 2, 3], target argmax [1, 2, 3 | bonus 4] -> all accepted + bonus.
    # Request B: drafts [5, 6], target argmax [5, 0 | 7] -> accept 5, correct 6 -> 0.
    # Request C: drafts [2], target argmax [3 | 1] -> reject at once, emit 3.
    # Request D: no drafts (prefill / plain decode), target argmax [6].
    logits = one_hot_logits([1, 2, 3, 4, 5, 0, 7, 3, 1, 6])
    out = RejectionSampler(method)(logits, [[1, 2, 3], [5, 6], [2], []], greedy_md(4))
    assert out.sampled_token_ids == [[1, 2, 3, 4], [5, 0], [3], [6]]
    assert out.num_draft_tokens == [3, 2, 1, 0]
    assert out.num_accepted_tokens == [3, 1, 0, 0]


def test_greedy_rejection_stops_at_first_mismatch_even_if_later_drafts_match():
    # Draft 1 mismatches; draft 2 equals its row's argmax but must not be accepted.
    logits = one_hot_logits([1, 4, 3, 0])
    out = RejectionSampler()(logits, [[1, 2, 3]], greedy_md(1))
    assert out.sampled_token_ids == [[1, 4]]
    assert out.num_accepted_tokens == [1]


def test_probabilistic_hand_cases_with_degenerate_targets():
    # Random request whose target puts all mass on one token per row (others -inf):
    # row 0 mass on 2, draft 2 -> accepted (p/q = 1); row 1 mass on 5, draft 3 -> p(3) = 0,
    # rejected; residual max(p - onehot(3), 0) = p -> emits 5.
    logits = torch.full((3, 8), NEG)
    logits[0, 2] = 0.0
    logits[1, 5] = 0.0
    logits[2, 1] = 0.0
    md = SamplingMetadata.from_sampling_params([Params(1.0)], "cpu")
    for method in ("strict", "probabilistic"):
        out = RejectionSampler(method)(logits, [[2, 3]], md)
        assert out.sampled_token_ids == [[2, 5]]
        assert out.num_accepted_tokens == [1]


def test_probabilistic_residual_excludes_overproposed_token():
    # p = [0.5, 0.5], q = [1, 0] on a draft of token 0: accept with prob 0.5; on rejection the
    # residual max(p - q, 0) = [0, 0.5] -> always token 1, never token 0 again.
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]])).repeat(500, 1)
    draft_probs = torch.tensor([[1.0, 0.0]]).repeat(500, 1)
    md = SamplingMetadata.from_sampling_params([Params(1.0)] * 500, "cpu")
    torch.manual_seed(3)
    out = RejectionSampler("probabilistic")(logits, [[0]] * 500, md, draft_probs)
    rejected = [s for s in out.sampled_token_ids if len(s) == 1]
    assert rejected and all(s == [1] for s in rejected)
    accepted = [s for s in out.sampled_token_ids if len(s) == 2]
    assert 150 < len(accepted) < 350


def _spec_trials(method, p_rows, q_rows, n_trials, seed, pass_draft_probs):
    """Drafts drawn from q (as a drafter would), verified against p; returns the outputs."""
    vocab = p_rows.shape[1]
    num_drafts = len(q_rows)
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q, n_trials, replacement=True, generator=gen)
                          for q in q_rows], dim=1)  # [n_trials, num_drafts]
    logits = torch.log(p_rows).repeat(n_trials, 1)  # rows per trial: drafts + bonus
    draft_probs = torch.stack(list(q_rows)).repeat(n_trials, 1) if pass_draft_probs else None
    md = SamplingMetadata.from_sampling_params([Params(1.0)] * n_trials, "cpu")
    torch.manual_seed(seed + 1)
    out = RejectionSampler(method)(logits.float(), drafts.tolist(), md,
                                   draft_probs.float() if draft_probs is not None else None)
    assert logits.shape == (n_trials * (num_drafts + 1), vocab)
    return out




@pytest.mark.parametrize("method,q_rows,pass_q", [
    ("probabilistic", Q_NONTRIVIAL, True),
    # Greedy-style drafter: it always proposes its argmax, so q is one-hot (draft_probs None).
    ("probabilistic", torch.eye(5, dtype=torch.float64)[[2, 0]], False),
    ("strict", Q_NONTRIVIAL, False),
])
def test_rejection_sampling_output_follows_target_distribution(method, q_rows, pass_q):
    n = 30000
    out = _spec_trials(method, P_ROWS, q_rows, n, seed=11, pass_draft_probs=pass_q)
    first = torch.tensor([s[0] for s in out.sampled_token_ids])
    counts0 = torch.bincount(first, minlength=5)
    assert chi_square_p_value(counts0, P_ROWS[0]) > 1e-3
    # Given the first draft was accepted, the next token must follow row 1 (drafts are drawn
    # independently here, so the target's conditional is just p1).
    second = torch.tensor([s[1] for s in out.sampled_token_ids if len(s) >= 2])
    assert len(second) > 2000
    assert chi_square_p_value(torch.bincount(second, minlength=5), P_ROWS[1]) > 1e-3
    # The test has power: the draft distribution itself is firmly rejected.
    assert chi_square_p_value(counts0, q_rows[0]) < 1e-6


def test_acceptance_rate_matches_theory():
    """Speculative sampling accepts a draft with probability sum_x min(p(x), q(x))."""
    n = 30000
    out = _spec_trials("probabilistic", P_ROWS, Q_NONTRIVIAL, n, seed=5, pass_draft_probs=True)
    first_accepted = sum(1 for k in out.num_accepted_tokens if k >= 1) / n
    theory = torch.minimum(P_ROWS[0], Q_NONTRIVIAL[0]).sum().item()
    assert abs(first_accepted - theory) < 4 * (theory * (1 - theory) / n) ** 0.5


def test_seeded_requests_reproduce_and_ignore_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    md1 = SamplingMetadata.from_sampling_params([Params(1.0, seed=9)], "cpu",
                                                {0: make_generator(9, "cpu")})
    alone = RejectionSampler("probabilistic")(logits, [[4, 7]], md1)
    neighbour_logits = torch.randn(2, 20)
    md2 = SamplingMetadata.from_sampling_params([Params(0.8), Params(1.0, seed=9)], "cpu",
                                                {1: make_generator(9, "cpu")})
    batched = RejectionSampler("probabilistic")(torch.cat([neighbour_logits, logits]),
                                                [[3], [4, 7]], md2)
    assert batched.sampled_token_ids[1] == alone.sampled_token_ids[0]


def test_bad_shapes_and_method_are_clear_errors():
    with pytest.raises(ValueError, match="rejection_sample_method"):
        RejectionSampler("typical")
    with pytest.raises(ValueError, match="sum\\(num_drafts \\+ 1\\)=3"):
        RejectionSampler()(torch.zeros(4, 8), [[1, 2]], greedy_md(1))
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler("probabilistic")(torch.zeros(3, 8), [[1, 2]], greedy_md(1),
                                          torch.zeros(3, 8))
    with pytest.raises(ValueError, match="sampling metadata has 2 rows"):
        RejectionSampler()(torch.zeros(3, 8), [[1, 2]], greedy_md(2))


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_zero_drafts_sample_exactly_as_the_plain_sampler(method):
    # A speculative runner samples a step in which nobody verifies drafts with the plain
    # Sampler; that is only sound if the rejection sampler would have emitted the same tokens
    # and drawn the same numbers from every request's generator (greedy, seeded, unseeded and
    # top-k/top-p rows mixed; the next draw of each generator must agree too).
    from vllm.v1.sample.sampler import Sampler
    params = [Params(0.0), Params(0.7, seed=3), Params(1.0, top_k=5, seed=11),
              Params(1.3, top_p=0.8, seed=5), Params(0.9)]
    torch.manual_seed(0)
    logits = torch.randn(len(params), 50)
    outs = []
    for use_plain in (True, False):
        gens = {i: make_generator(p.seed, "cpu") for i, p in enumerate(params) if p.seed}
        md = SamplingMetadata.from_sampling_params(params, "cpu", gens)
        torch.manual_seed(123)  # the unseeded row's draws
        if use_plain:
            tokens = Sampler()(logits, md).tolist()
        else:
            tokens = [row[0] for row in
                      RejectionSampler(method)(logits, [[]] * len(params), md).sampled_token_ids]
        after = [torch.rand(1, generator=g).item() for _, g in sorted(gens.items())]
        outs.append((tokens, after, torch.rand(1).item()))
    assert outs[0] == outs[1]
