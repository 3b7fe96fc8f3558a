"""The fused step-preparation Triton kernel equals its torch twin (the CPU path, itself checked
against brute force in test_input_batch*.py) on random batches: every buffer it writes, padding
and PAD slots included."""
from __future__ import annotations

import pytest
import torch

from tests.utils.prepare_step_cases import outputs, random_prep_case
from vllm.v1.worker.gpu.prepare_step import prepare_step_torch, prepare_step_triton


@pytest.mark.gpu
def test_fused_prepare_kernel_equals_torch_twin_on_cuda():
    for seed in range(60):
        ref, args = random_prep_case(seed, "cuda")
        got, _ = random_prep_case(seed, "cuda")
        prepare_step_torch(ref, **args)
        num_logits = args.pop("num_logits")
        prepare_step_triton(got, **args)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(outputs(ref), outputs(got))):
            assert torch.equal(a, b), (seed, i, num_logits, a, b)
