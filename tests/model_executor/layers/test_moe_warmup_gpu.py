"""On the GPU, after an engine has started, no request makes a MoE Triton kernel compile
(vllm/model_executor/layers/moe_warmup.py): prefills of lengths in every power-of-two bucket up
to the token budget, alone and batched, and their decode steps find every form compiled.

Oracle: the kernels' own in-process caches of compiled kernels (Triton's JITFunction keeps one
per device: the first element of each `device_caches` entry), counted before and after."""
from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams


def _compiled(kernels) -> int:
    return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())


@pytest.mark.gpu
def test_no_moe_kernel_compiles_after_start_up():
    from vllm.model_executor.layers import moe_kernels, moe_routing
    kernels = (moe_routing._route_kernel, moe_routing._align_kernel,
               moe_kernels._moe_gate_up_kernel, moe_kernels._moe_down_kernel)
    lengths = (3, 37, 150, 333, 700, 1000)
    prompts = [[(7 * i + n) % 200 + 20 for i in range(n)] for n in lengths]
    with LLM(max_model_len=1100, max_num_seqs=8, max_num_batched_tokens=1024) as llm:
        at_start = _compiled(kernels)
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for prompt in prompts:  # one at a time: each prefill pass has its own length
            llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy, use_tqdm=False)
        after = _compiled(kernels)
    assert at_start > 0  # the tiny model's MoE layers run these kernels, warmed at start-up
    assert after == at_start, (at_start, after)
