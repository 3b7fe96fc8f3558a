"""Runs DSpark's fused greedy Markov draft kernel (markov_greedy.py) on CPU tensors under
TRITON_INTERPRET=1 against the speculator's torch ops (launched by
tests/v1/spec_decode/test_markov_greedy.py)."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.interpret_checks import run_checks  # noqa: E402
from tests.utils.markov_drafts_reference import greedy_gaps, torch_chain  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dspark import markov_greedy  # noqa: E402

# (rows, positions, vocabulary, rank)
SHAPES = ((1, 4, 260, 64),   # the tiny model's head, B=1, k=4
          (8, 4, 260, 64),   # B=8
          (3, 1, 17, 5),     # one position, a rank and vocabulary that are not powers of two
          (5, 8, 1000, 32),  # several W2 tiles per position, k=8
          (2, 3, 64, 256))   # the largest rank served


def check_float32(gen) -> None:
    """float32: exactly the torch form's drafts (random logits and heads: no ties)."""
    for rows, k, vocab, rank in SHAPES:
        assert markov_greedy.markov_greedy_supported(vocab, rank), (vocab, rank)
        logits = torch.randn(rows, k, vocab, generator=gen) * 2
        w1 = torch.randn(vocab, rank, generator=gen) / rank ** 0.5
        w2 = torch.randn(vocab, rank, generator=gen)
        anchors = torch.randint(0, vocab, (rows,), generator=gen)
        got = markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)
        ref = torch_chain(logits, anchors, w1, w2)
        assert got.dtype == torch.int64 and got.shape == (rows, k)
        assert torch.equal(got, ref), (rows, k, vocab, rank, got, ref)


def check_bfloat16(gen) -> None:
    """bf16 logits and head: the torch form's drafts, or (where the float32 dot-product order
    moved a bias by its last bit) a choice within 1e-2 of the position's float64 maximum."""
    same = total = 0
    for rows, k, vocab, rank in SHAPES:
        logits = (torch.randn(rows, k, vocab, generator=gen) * 2).bfloat16()
        w1 = (torch.randn(vocab, rank, generator=gen) / rank ** 0.5).bfloat16()
        w2 = torch.randn(vocab, rank, generator=gen).bfloat16()
        anchors = torch.randint(0, vocab, (rows,), generator=gen)
        got = markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)
        ref = torch_chain(logits, anchors, w1, w2)
        same += int((got == ref).all(dim=1).sum())
        total += rows
        assert float(greedy_gaps(got, logits, anchors, w1, w2).max()) < 1e-2, (rows, vocab)
    assert same >= total - 2, (same, total)


def check_ties_and_views(gen) -> None:
    """Exact ties take the first index (torch.argmax's rule), across W2 tiles too; logits may
    be a view of wider rows (a padded vocabulary sliced to the head's)."""
    vocab, rank = 300, 64  # W2 tiles of 64 rows: 7 and 250 lie in different tiles
    assert markov_greedy.markov_greedy_supported(vocab, rank)
    w1 = torch.zeros(vocab, rank)
    w2 = torch.zeros(vocab, rank)  # no bias: the logits alone decide
    logits = torch.zeros(2, 3, vocab)
    logits[0, 0, [7, 250]] = 5.0     # a tie in two tiles: 7
    logits[0, 1, [299, 3]] = 1.0     # 3
    logits[1, :, :] = -1.0           # all equal: 0
    logits[1, 2, [100, 101]] = 2.0   # 100
    anchors = torch.tensor([1, 2])
    got = markov_greedy.markov_greedy_drafts(logits, anchors, w1, w2)
    assert got.tolist() == [[7, 3, 0], [0, 0, 100]], got.tolist()
    assert torch.equal(got, torch_chain(logits, anchors, w1, w2))
    wide = torch.randn(4, 2, vocab + 12, generator=gen)
    w1 = torch.randn(vocab, rank, generator=gen)
    w2 = torch.randn(vocab, rank, generator=gen)
    anchors = torch.randint(0, vocab, (4,), generator=gen)
    view = wide[..., :vocab]
    assert torch.equal(markov_greedy.markov_greedy_drafts(view, anchors, w1, w2),
                       torch_chain(view, anchors, w1, w2))


def main() -> None:
    run_checks(markov_greedy.HAS_TRITON, check_float32, check_bfloat16, check_ties_and_views)


if __name__ == "__main__":
    main()
