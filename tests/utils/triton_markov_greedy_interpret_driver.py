"""Runs DSpark's fused greedy Markov draft kernel (markov_greedy.py) on CPU tensors under
TRITON_INTERPRET=1 against the speculator's torch ops (launched by
tests/v1/spec_decode/test_markov_greedy.py)."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.interpret_checks import run_checks  # noqa: E402
from tests.utils.markov_drafts_reference import (greedy_gap_bounds, greedy_gaps,  # noqa: E402
                                                 table_chain, torch_chain)
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


def _truncating_table_chain(logits, anchors, table):
    """table_chain with the interpreter's float32 -> bf16 rounding (toward zero: the low 16
    bits dropped) where torch and the GPU round to nearest even."""
    drafts = torch.empty(logits.shape[0], logits.shape[1], dtype=torch.int64)
    previous = anchors
    for j in range(logits.shape[1]):
        total = logits[:, j, :].float() + table[previous].float()
        rounded = (total.view(torch.int32) & -65536).view(torch.float32)
        previous = rounded.argmax(dim=-1)
        drafts[:, j] = previous
    return drafts


def check_bias_table(gen) -> None:
    """The bias-table kernel: exactly the torch chain over the same table in float32 (and the
    torch form's drafts), and in bf16 exactly that chain with the interpreter's rounding
    (Triton's interpreter rounds float32 to bf16 toward zero where the GPU and torch round to
    nearest even; the GPU test holds the kernel to table_chain itself), whose choice is greedy
    for the head's float64 biased logits within twice the chain's rounding bound (truncation
    errs by up to one ulp, not half). Vocabularies of 17-1000; then a first-index tie and a
    view of wider logits."""
    for rows, k, vocab, rank in SHAPES[:4]:
        for dtype in (torch.float32, torch.bfloat16):
            assert markov_greedy.bias_table_supported(vocab), vocab
            logits = (torch.randn(rows, k, vocab, generator=gen) * 2).to(dtype)
            w1 = (torch.randn(vocab, rank, generator=gen) / rank ** 0.5).to(dtype)
            w2 = torch.randn(vocab, rank, generator=gen).to(dtype)
            anchors = torch.randint(0, vocab, (rows,), generator=gen)
            table = markov_greedy.markov_bias_table(w1, w2, dtype)
            got = markov_greedy.markov_table_drafts(logits, anchors, table)
            assert got.dtype == torch.int64 and got.shape == (rows, k)
            if dtype == torch.float32:
                assert torch.equal(got, table_chain(logits, anchors, table)), (rows, vocab)
                assert torch.equal(got, torch_chain(logits, anchors, w1, w2)), (rows, vocab)
                continue
            assert torch.equal(got, _truncating_table_chain(logits, anchors, table)), (rows, vocab)
            gaps = greedy_gaps(got, logits, anchors, w1, w2)
            bounds = greedy_gap_bounds(got, logits, anchors, w1, w2)
            assert bool((gaps <= 2 * bounds).all()), (rows, vocab)
    vocab = 300
    table = torch.zeros(vocab, vocab)
    logits = torch.zeros(1, 2, vocab)
    logits[0, 0, [250, 7]] = 5.0  # a tie: 7
    logits[0, 1, :] = -1.0        # all equal: 0
    got = markov_greedy.markov_table_drafts(logits, torch.tensor([3]), table)
    assert got.tolist() == [[7, 0]], got.tolist()
    wide = torch.randn(4, 2, vocab + 12, generator=gen)
    table = torch.randn(vocab, vocab, generator=gen)
    anchors = torch.randint(0, vocab, (4,), generator=gen)
    view = wide[..., :vocab]
    assert torch.equal(markov_greedy.markov_table_drafts(view, anchors, table),
                       table_chain(view, anchors, table))


def main() -> None:
    run_checks(markov_greedy.HAS_TRITON, check_float32, check_bfloat16, check_ties_and_views,
               check_bias_table)


if __name__ == "__main__":
    main()
