"""Penalties, logits processors and logprobs against brute-force per-element Python loops."""
import math

import pytest
import torch

from vllm.v1.sample.logprobs import compute_logprobs, gather_logprobs
from vllm.v1.sample.ops.logits_processors import (apply_logit_bias, apply_min_p, apply_min_tokens,
                                                  apply_token_mask)
from vllm.v1.sample.ops.penalties import apply_penalties, segment_draft_counts

V = 11


def _rows(seed=0, r=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, V, generator=g, dtype=torch.float64) * 3


def test_penalties_match_brute_force():
    logits = _rows()
    outputs = [[1, 1, 3], [], [0, 10, 10, 10], [5]]
    prompts = [[2, 3], [4], [], [5, 6]]
    pres, freq, rep = [0.5, 0.0, -0.3, 1.0], [0.2, 1.0, 0.7, 0.0], [1.3, 2.0, 0.8, 1.0]
    counts = torch.zeros(4, V, dtype=torch.int32)
    pmask = torch.zeros(4, V, dtype=torch.bool)
    for r in range(4):
        for t in outputs[r]:
            counts[r, t] += 1
        for t in prompts[r]:
            pmask[r, t] = True
    got = apply_penalties(logits, counts, pmask, torch.tensor(pres), torch.tensor(freq),
                          torch.tensor(rep))
    for r in range(4):
        for t in range(V):
            x = float(logits[r, t])
            if t in outputs[r] or t in prompts[r]:
                x = x / rep[r] if x > 0 else x * rep[r]
            c = outputs[r].count(t)
            x -= freq[r] * c
            x -= pres[r] * (1 if c else 0)
            assert math.isclose(float(got[r, t]), x, rel_tol=1e-5, abs_tol=1e-5), (r, t)


def test_segment_draft_counts_brute_force():
    # Three requests: 2 drafts (rows 0-2), 0 drafts (row 3), 3 drafts (rows 4-7).
    drafts = [[4, 4], [], [1, 2, 1]]
    starts, draft_rows, draft_tokens, row_start = [], [], [], []
    row = 0
    for d in drafts:
        starts.append(row)
        for j, t in enumerate(d):
            draft_rows.append(row + j)
            draft_tokens.append(t)
        row_start += [row] * (len(d) + 1)
        row += len(d) + 1
    got = segment_draft_counts(torch.tensor(row_start), torch.tensor(draft_rows),
                               torch.tensor(draft_tokens), row, V)
    expected = torch.zeros(row, V, dtype=torch.int32)
    for s, d in zip(starts, drafts):
        for j in range(len(d) + 1):
            for t in d[:j]:
                expected[s + j, t] += 1
    assert torch.equal(got, expected)


def test_bias_mask_min_tokens():
    logits = _rows(1)
    bias = torch.zeros(4, V)
    bias[0, 3] = 5.0
    bias[2, 0] = -100.0
    out = apply_logit_bias(logits, bias)
    assert torch.allclose(out, logits.float() + bias)
    banned = torch.zeros(4, V, dtype=torch.bool)
    banned[1, [0, 1, 2]] = True
    masked = apply_token_mask(logits, banned)
    for r in range(4):
        for t in range(V):
            assert (masked[r, t] == float("-inf")) == bool(banned[r, t])
    stop = torch.zeros(4, V, dtype=torch.bool)
    stop[:, 7] = True
    stop[3, 2] = True
    num_out = torch.tensor([0, 5, 2, 1])
    min_tok = torch.tensor([3, 5, 0, 2])
    held = apply_min_tokens(logits, num_out, min_tok, stop)
    for r in range(4):
        for t in range(V):
            blocked = int(num_out[r]) < int(min_tok[r]) and bool(stop[r, t])
            assert (held[r, t] == float("-inf")) == blocked, (r, t)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_brute_force(temperature):
    logits = _rows(2)
    min_p = torch.tensor([0.0, 0.1, 0.5, 1.0])
    temp = torch.tensor([temperature, temperature, temperature, 0.0])
    got = apply_min_p(logits, min_p, temp)
    for r in range(4):
        if temp[r] == 0 or min_p[r] == 0:
            assert torch.equal(got[r], logits[r])
            continue
        probs = torch.softmax(logits[r] / temperature, dim=-1)
        for t in range(V):
            keep = float(probs[t]) >= float(min_p[r]) * float(probs.max()) - 1e-12
            assert (got[r, t] != float("-inf")) == keep, (r, t)


@pytest.mark.parametrize("k", [0, 1, 3, -1])
def test_logprobs_topk_and_rank(k):
    logits = _rows(3, r=5)
    logits[4, 2] = logits[4, 5] = logits[4].max() + 1  # a tie at the top
    tokens = torch.tensor([0, 3, 10, 7, 5])
    lp = compute_logprobs(logits)
    ref = torch.log_softmax(logits, dim=-1)  # float64 reference
    out = gather_logprobs(lp, k, tokens).tolists()
    width = V if k == -1 else k
    for r in range(5):
        t = int(tokens[r])
        assert out.logprob_token_ids[r][0] == t
        assert math.isclose(out.logprobs[r][0], float(ref[r, t]), abs_tol=1e-5)
        rank = sum(1 for v in range(V) if float(ref[r, v]) >= float(ref[r, t]) - 1e-7)
        assert out.sampled_token_ranks[r] == rank
        order = sorted(range(V), key=lambda v: -float(ref[r, v]))[:width]
        top_vals = [float(ref[r, v]) for v in order]
        assert len(out.logprob_token_ids[r]) == width + 1
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(out.logprobs[r][1:], top_vals))
        for v, val in zip(out.logprob_token_ids[r][1:], out.logprobs[r][1:]):
            assert math.isclose(float(ref[r, v]), val, abs_tol=1e-5)
    assert out.sampled_token_ranks[4] == 2  # token 5 ties with token 2 at the top


def test_gather_logprobs_rejects_bad_k():
    with pytest.raises(ValueError, match="num_logprobs=99"):
        gather_logprobs(torch.zeros(1, V), 99, torch.tensor([0]))


def test_sampling_states_host_and_device_drafts_agree():
    """The runner may hand drafts as host lists or as (num_draft, flat device tensor)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample_utils import BatchRows, SamplingStates

    def run(rows):
        states = SamplingStates(max_num_reqs=3, vocab_size=V, device=torch.device("cpu"))
        p = SamplingParams(temperature=0.0, presence_penalty=0.7, repetition_penalty=1.5,
                           min_tokens=3, bad_words=["x"])
        p.update_from_tokenizer(eos_token_id=1)
        p._bad_words_token_ids = [[4, 5]]  # a two-token word: 5 is banned right after 4
        states.add_request("r0", 0, [2, 3], p)
        states.add_request("r1", 2, [6], p)
        return states.process_logits(_rows(5, r=5).float(), rows)

    host = BatchRows(["r0", "r1"], [0, 2], [[4, 4, 7], []], [[2, 3], [6]])
    device = BatchRows(["r0", "r1"], [0, 2], None, [[2, 3], [6]], num_draft=[3, 0],
                       draft_tokens=torch.tensor([4, 4, 7]))
    a, b = run(host), run(device)
    assert torch.equal(a, b)
    # Row 1 and 2 of r0 follow a draft 4: token 5 is banned there. EOS (1) is held back while
    # fewer than 3 tokens precede the row: r0's rows 0-2 and r1's row; r0's bonus row (after 3
    # drafts) may end the request.
    assert torch.isinf(a[1, 5]) and torch.isinf(a[2, 5]) and not torch.isinf(a[0, 5])
    assert torch.isinf(a[[0, 1, 2, 4], 1]).all() and not torch.isinf(a[3, 1])


def test_any_active_equals_a_per_slot_check_through_admissions_and_removals():
    """any_active keeps a set of featured slots; it must always equal the per-slot definition
    (some row's request uses a feature), however requests come and go and reuse slots."""
    import numpy as np

    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample_utils import BatchRows, SamplingStates
    gen = np.random.default_rng(0)
    states = SamplingStates(6, 16, torch.device("cpu"))
    plain = SamplingParams(temperature=0.0)
    featured = [SamplingParams(temperature=0.0, presence_penalty=0.5),
                SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                SamplingParams(temperature=0.5, min_p=0.1)]
    resident: dict[int, str] = {}
    for step in range(200):
        slot = int(gen.integers(0, 6))
        if slot in resident and gen.random() < 0.5:
            states.remove_request(resident.pop(slot), slot, finished=bool(gen.random() < 0.5))
        else:
            if slot in resident:
                states.remove_request(resident.pop(slot), slot, finished=True)
            params = plain if gen.random() < 0.6 else featured[int(gen.integers(0, 3))]
            resident[slot] = f"r{step}"
            states.add_request(resident[slot], slot, [1, 2, 3], params)
        slots = sorted(resident)
        if not slots:
            continue
        rows = BatchRows(req_ids=[resident[s] for s in slots], slots=slots)
        brute = any(states._features.get(s) for s in slots)
        assert states.any_active(rows) == brute
        half = BatchRows(req_ids=[resident[s] for s in slots[::2]], slots=slots[::2])
        assert states.any_active(half) == any(states._features.get(s) for s in slots[::2])
