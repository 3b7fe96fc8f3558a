"""apply_verified_step (numpy) against the per-row loop it replaced, on random steps."""
import numpy as np
import pytest

from vllm.v1.worker.gpu.spec_decode.step_output import apply_verified_step


def _reference(host, num_draft, sample_rows, num_reqs, num_computed_new):
    out = [[] for _ in range(num_reqs)]
    nd = [0] * num_reqs
    acc = [0] * num_reqs
    ncn = num_computed_new.copy()
    for j, row in enumerate(sample_rows):
        n = int(host[j, -1])
        out[row] = [int(t) for t in host[j, :n]]
        nd[row] = int(num_draft[j])
        acc[row] = n - 1
        ncn[row] -= int(num_draft[j]) - (n - 1)
    return out, nd, acc, ncn


@pytest.mark.parametrize("seed", range(40))
def test_matches_per_row_loop(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(0, 8))
    num_reqs = int(rng.integers(1, 40))
    # any subset of rows samples (unfinished prefill chunks do not), in batch order; every
    # row in a third of the cases (the steady verify step's own path)
    mask = rng.random(num_reqs) < 0.8 if seed % 3 else np.ones(num_reqs, dtype=bool)
    sample_rows = np.flatnonzero(mask).tolist()
    s = len(sample_rows)
    num_draft = rng.integers(0, k + 1, size=s)
    n_emit = np.array([rng.integers(1, d + 2) for d in num_draft], dtype=np.int64)
    host = rng.integers(0, 50000, size=(s, k + 2)).astype(np.int64)
    host[:, -1] = n_emit
    ncn = rng.integers(10, 1000, size=num_reqs).astype(np.int64)
    ref = _reference(host, num_draft, sample_rows, num_reqs, ncn)
    out = [[] for _ in range(num_reqs)]
    got_ncn = ncn.copy()
    nd, acc = apply_verified_step(host, num_draft, sample_rows, num_reqs, got_ncn, out)
    assert out == ref[0]
    assert nd == ref[1] and acc == ref[2]
    assert all(type(x) is int for x in nd + acc)
    assert all(type(t) is int for toks in out for t in toks)
    np.testing.assert_array_equal(got_ncn, ref[3])
