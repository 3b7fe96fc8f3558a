"""The plan model's cluster permutation (tests/utils/flashinfer_mla_plan_model.py), which the
GPU test of test_flashinfer_mla_gpu.py applies to FlashInfer's own plans: the permuted plan
holds the same work items (each with all its fields), dealt to the clusters in the new order,
and is still a valid plan of the same requests."""
import numpy as np
import pytest
import torch

from tests.utils.flashinfer_mla_plan_model import (assert_valid_plan, model_plan,
                                                   permute_clusters, plan_works)


def _works_by_cluster(ws, info):
    works = plan_works(ws.numpy(), info)
    start = info[2 + 13] // 4  # work_indptr
    indptr = ws[start:start + info[1] + 1].tolist()
    return [works[indptr[c]:indptr[c + 1]] for c in range(info[1])]


@pytest.mark.parametrize("causal", [False, True])
def test_a_permuted_plan_deals_the_same_works_to_other_clusters(causal):
    qo = np.array([0, 5, 10, 15, 20], dtype=np.int32)
    kv = np.array([700, 2049, 64, 9], dtype=np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(-(-kv // 64))]).astype(np.int32)
    info, scratch, limit = model_plan(qo, kv, kv_indptr, 16, num_sm=8, causal=causal)
    ws = scratch.view(torch.int32)
    before = _works_by_cluster(ws, info)
    assert sum(1 for c in before if c) > 2  # several clusters hold works
    order = list(reversed(range(info[1])))
    permute_clusters(ws, info, order)
    after = _works_by_cluster(ws, info)
    assert after == [before[c] for c in order]
    if not causal:
        assert_valid_plan(plan_works(ws.numpy(), info), qo, kv, kv_indptr, limit)
    identity = ws.clone()
    permute_clusters(ws, info, list(range(info[1])))
    assert torch.equal(ws, identity)
    with pytest.raises(ValueError, match="permutation"):
        permute_clusters(ws, info, [0] * info[1])
