import pytest
import torch
from hypothesis import given, settings, strategies as st

from vllm.v1.sample.metadata import RequestGenerators, SamplingMetadata, make_generator
from vllm.v1.sample.sampler import Sampler
from vllm.v1.sample.topk_topp import apply_top_k_top_p

from tests.utils.sampling import Params
from tests.utils.stats_helpers import chi_square_p_value




def test_greedy_rows_take_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.0]])
    md = SamplingMetadata.from_sampling_params([Params(0.0), None, Params(0.0)], "cpu")
    assert md.all_greedy
    assert Sampler()(logits, md).tolist() == [1, 0, 3]


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [Params(0.0), Params(1.0), Params(0.0), Params(2.0), Params(0.0), Params(0.5)]
    md = SamplingMetadata.from_sampling_params(params, "cpu")
    assert not md.all_greedy and not md.all_random
    tokens = Sampler()(logits, md)
    for row in (0, 2, 4):
        assert tokens[row].item() == logits[row].argmax().item()


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    n = 20000
    md = SamplingMetadata.from_sampling_params([Params(temperature)] * n, "cpu")
    torch.manual_seed(1234)
    tokens = Sampler()(logits.expand(n, -1).clone(), md)
    counts = torch.bincount(tokens, minlength=5)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert chi_square_p_value(counts, expected) > 1e-3
    # The test has power: the untempered distribution is rejected when T is far from 1.
    if temperature != 1.0:
        assert chi_square_p_value(counts, torch.softmax(logits.double(), -1)) < 1e-6


def test_top_k_top_p_sampling_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    md = SamplingMetadata.from_sampling_params([Params(1.0, top_k=4, top_p=0.8)] * n, "cpu")
    torch.manual_seed(7)
    counts = torch.bincount(Sampler()(logits.expand(n, -1).clone(), md), minlength=6)
    probs = torch.softmax(logits.double(), -1)[:4]
    probs = probs / probs.sum()
    # Nucleus over the top-4 renormalised: keep tokens whose mass strictly above is < 0.8.
    above = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(0)[:-1]])
    kept = probs * (above < 0.8)
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:4] = kept / kept.sum()
    assert counts[4:].sum() == 0
    assert chi_square_p_value(counts, expected) > 1e-3


def _brute_force_keep(logits_row: torch.Tensor, k: int, p: float) -> list[bool]:
    """Keep-set by definition, in float64, token by token."""
    values = logits_row.double().tolist()
    vocab = len(values)
    keep = [True] * vocab
    if 0 < k < vocab:
        for i, v in enumerate(values):
            greater = sum(1 for w in values if w > v)
            keep[i] = greater < k
    if p < 1.0:
        kept_vals = [v if keep[i] else float("-inf") for i, v in enumerate(values)]
        probs = torch.softmax(torch.tensor(kept_vals, dtype=torch.float64), 0).tolist()
        for i in range(vocab):
            if keep[i]:
                mass_above = sum(q for j, q in enumerate(probs) if probs[j] > probs[i])
                keep[i] = mass_above < p
    return keep


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.data())
def test_top_k_top_p_mask_matches_brute_force(vocab, rows, data):
    seed = data.draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    ks = data.draw(st.lists(st.integers(0, vocab + 1), min_size=rows, max_size=rows))
    ps = data.draw(st.lists(st.sampled_from([1.0, 0.95, 0.7, 0.5, 0.3, 0.05]),
                            min_size=rows, max_size=rows))
    masked = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps, dtype=torch.float32))
    for r in range(rows):
        expected = _brute_force_keep(logits[r], ks[r], ps[r])
        # Skip tokens whose mass-above sits within float32 rounding of p (either answer is right).
        row = logits[r].double()
        kvals = row.clone()
        if 0 < ks[r] < vocab:
            kvals[~torch.tensor([sum(1 for w in row.tolist() if w > v) < ks[r]
                                 for v in row.tolist()])] = float("-inf")
        probs = torch.softmax(kvals, 0)
        for i in range(vocab):
            above = probs[probs > probs[i]].sum().item()
            if ps[r] < 1.0 and abs(above - ps[r]) < 1e-5:
                continue
            assert (masked[r, i] != float("-inf")).item() == expected[i], (r, i, ks[r], ps[r])


def test_per_request_generator_makes_draws_independent_of_batch():
    """A seeded request draws the same tokens whatever else is in the batch (needed so that all
    ranks, and a re-batched schedule, agree)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    md_alone = SamplingMetadata.from_sampling_params([Params(1.0, seed=42)], "cpu",
                                                     {0: make_generator(42, "cpu")})
    alone = [Sampler()(logits[1:2], md_alone).item() for _ in range(5)]
    gens = {1: make_generator(42, "cpu")}
    md_batch = SamplingMetadata.from_sampling_params([Params(1.0), Params(1.0, seed=42), Params(0.0)],
                                                     "cpu", gens)
    batched = [Sampler()(logits, md_batch)[1].item() for _ in range(5)]
    assert alone == batched
    assert len(set(alone)) > 1  # the generator state advances between steps


def test_request_generators_store():
    store = RequestGenerators("cpu", engine_seed=5)
    store.add_request("a", Params(1.0, seed=11))
    store.add_request("g", Params(0.0))
    store.add_request("b", Params(1.0))
    assert store.get("g") is None
    assert store.get("a").initial_seed() == 11
    assert store.get("b").initial_seed() == 5 + 2
    assert set(store.for_batch(["g", "b", "a"])) == {1, 2}
    store.remove_request("a")
    assert store.get("a") is None


def test_logits_shape_mismatch_is_a_clear_error():
    md = SamplingMetadata.from_sampling_params([Params(0.0)] * 2, "cpu")
    with pytest.raises(ValueError, match="num_reqs=2"):
        Sampler()(torch.zeros(3, 4), md)
