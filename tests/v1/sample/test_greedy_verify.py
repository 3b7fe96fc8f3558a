"""The one-launch greedy verification (vllm/v1/sample/ops/greedy_verify.py) equals the device
rejection sampler on ragged batches: rows with 0..k drafts, rows that do not sample (no logits),
sampling rows that are a subset of the batch rows, every acceptance length. The oracle is
RejectionSampler.verify with greedy metadata (plus a per-row Python brute force of the accepted
prefix); the Triton kernel's own check against this twin runs under the interpreter
(tests/utils/triton_greedy_verify_interpret_driver.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.utils.greedy_verify_cases import random_greedy_verify_case
from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.greedy_verify import greedy_verify_torch
from vllm.v1.sample.rejection_sampler import RejectionSampler


def _oracle(case):
    """(tokens [S, k+1] -1 padded, counts [S], anchors {slot: token}) from the rejection
    sampler over the sampling rows' logits and drafts."""
    k = case["draft_tokens"].shape[1]
    cu, rows, slots = case["cu_np"], case["rows_np"], case["slots_np"]
    logit_rows = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in rows])
    num_drafts = np.array([cu[r + 1] - cu[r] - 1 for r in rows], dtype=np.int64)
    drafts = torch.cat([case["draft_tokens"][slots[r], : cu[r + 1] - cu[r] - 1] for r in rows])
    md = SamplingMetadata(temperature=torch.zeros(len(rows)), all_greedy=True, all_random=False)
    res = RejectionSampler("strict").verify(case["logits"][torch.from_numpy(logit_rows)], drafts,
                                            num_drafts, md)
    tokens = torch.full((len(rows), k + 1), -1, dtype=torch.int64)
    tokens[:, : res.sampled.shape[1]] = res.sampled
    anchors = {int(slots[r]): int(res.sampled[j, res.num_accepted[j]])
               for j, r in enumerate(rows)}
    return tokens, res.num_sampled, anchors


def _brute_counts(case):
    """Accepted prefix per sampling row, one Python comparison at a time."""
    greedy = case["logits"].argmax(-1).tolist()
    cu, out = case["cu_np"], []
    for r in case["rows_np"]:
        drafts = case["draft_tokens"][case["slots_np"][r]].tolist()
        n, a = int(cu[r + 1] - cu[r] - 1), 0
        while a < n and drafts[a] == greedy[cu[r] + a]:
            a += 1
        out.append(a + 1)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_greedy_verify_torch_equals_rejection_sampler(seed):
    case = random_greedy_verify_case(seed)
    k = case["draft_tokens"].shape[1]
    last_sampled, out = case["last_sampled"].clone(), case["out"].clone()
    S = len(case["rows_np"])
    greedy_verify_torch(case["logits"].argmax(-1), case["cu"], case["slots"], case["rows"],
                        case["draft_tokens"], last_sampled, out, S)
    tokens, counts, anchors = _oracle(case)
    assert torch.equal(out[:S, : k + 1], tokens)
    assert out[:S, k + 1].tolist() == counts.tolist() == _brute_counts(case)
    assert torch.equal(out[S:], case["out"][S:])  # rows past the sampling rows untouched
    expected = case["last_sampled"].clone()
    for slot, token in anchors.items():
        expected[slot] = token
    assert torch.equal(last_sampled, expected)  # only the sampling rows' slots move


def test_cases_cover_every_acceptance_length_and_ragged_rows():
    """The random cases reach full acceptance, zero acceptance, rows without drafts and
    batches whose sampling rows are a strict subset (else the test above proves little)."""
    k_seen, partial, no_draft = set(), False, False
    for seed in range(40):
        case = random_greedy_verify_case(seed)
        cu, rows = case["cu_np"], case["rows_np"]
        partial |= len(rows) < len(case["slots_np"])
        no_draft |= any(cu[r + 1] - cu[r] == 1 for r in rows)
        counts = _brute_counts(case)
        k_seen |= {(c - 1, int(cu[r + 1] - cu[r] - 1)) for c, r in zip(counts, rows)}
    assert partial and no_draft
    assert any(a == n > 0 for a, n in k_seen) and any(a == 0 < n for a, n in k_seen)


@pytest.mark.slow
def test_greedy_verify_kernel_equals_torch_under_interpreter():
    run_interpreter_driver(Path(__file__).parents[2].joinpath(
        "utils", "triton_greedy_verify_interpret_driver.py"))
