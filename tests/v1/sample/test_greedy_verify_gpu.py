"""The greedy verification kernel on CUDA writes what its torch twin writes (GPU node; the CPU
suite checks the twin against the rejection sampler and the kernel under the interpreter)."""
import pytest
import torch

from tests.utils.greedy_verify_cases import random_greedy_verify_case
from vllm.v1.sample.ops.greedy_verify import greedy_verify_torch, greedy_verify_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(40))
def test_greedy_verify_kernel_equals_torch_on_cuda(seed):
    case = random_greedy_verify_case(seed, device="cuda")
    S = len(case["rows_np"])
    greedy = case["logits"].argmax(-1)
    results = []
    for fn in (greedy_verify_torch, greedy_verify_triton):
        last_sampled, out = case["last_sampled"].clone(), case["out"].clone()
        fn(greedy, case["cu"], case["slots"], case["rows"], case["draft_tokens"], last_sampled,
           out, S)
        results.append((last_sampled.cpu(), out.cpu()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
