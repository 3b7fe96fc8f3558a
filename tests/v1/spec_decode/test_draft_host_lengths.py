"""The draft builder's host twin of the rank-local lengths (cp_utils.dcp_local_seq_lens_np, numpy
into a persistent buffer) against enumeration (DESIGN §2), and through the builder for the
EAGLE-style (host seq_lens given) and CPU-device (read from the device buffer) paths."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.utils.spec_fakes import brute_local_len, make_speculator
from vllm.v1.worker.gpu.cp_utils import dcp_local_seq_lens_np
from vllm.v1.worker.gpu.spec_decode.speculator import Speculator


@pytest.mark.parametrize("seed", range(20))
def test_numpy_local_lengths_equal_enumeration(seed):
    rng = random.Random(seed)
    cp_size = rng.choice([1, 2, 3, 4, 8])
    cp_rank, interleave = rng.randrange(cp_size), rng.choice([1, 2, 4, 16])
    lens = np.array([rng.randrange(0, 300) for _ in range(rng.randint(0, 12))], dtype=np.int32)
    out = np.full(16, -1, dtype=np.int32)
    got = dcp_local_seq_lens_np(lens, cp_size, cp_rank, interleave, out=out)
    assert got.tolist() == [brute_local_len(int(n), cp_size, cp_rank, interleave) for n in lens]
    assert np.shares_memory(got, out) and (out[len(lens):] == -1).all()


@pytest.mark.parametrize("host_lengths", [True, False])
def test_builder_host_local_lengths_follow_each_build(host_lengths):
    spec, (builder,) = make_speculator(Speculator, cp_size=4, cp_rank=3, interleave=2)
    for lens in ([9, 30, 2], [70, 1], [8, 8, 8]):
        n = len(lens)
        spec.input_buffers.seq_lens[:n] = torch.tensor(lens, dtype=torch.int32)
        spec._build_draft_attn_metadata(n, n + 1, n + 1, np.array(lens), step=1,
                                        seq_lens_np=np.array(lens) if host_lengths else None)
        host = builder.calls[-1].common.dcp_local_seq_lens_cpu
        assert host.tolist() == [brute_local_len(x, 4, 3, 2) for x in lens] + [0]
