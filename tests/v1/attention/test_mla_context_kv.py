"""The block drafters' fused context-KV write (v1/attention/ops/mla_context_kv.py): all draft
layers' RMSNorm + rope + cache write in one launch. Its kernel runs under Triton's CPU
interpreter against the per-layer path's own kernels (bit for bit) and the torch formula
(tests/utils/triton_fused_ops_interpret_driver.py, check_context_kv); the GPU compilation and
the model-level path: tests/model_executor/layers/attention/test_mla_context_kv_writer.py."""
from pathlib import Path

import pytest
import torch

from tests.utils.triton_interpreter import run_interpreter_driver
from vllm.v1.attention.ops.mla_context_kv import write_context_kv_layers

DRIVER = Path(__file__).parents[2].joinpath("utils", "triton_fused_ops_interpret_driver.py")


def test_fused_context_kv_kernel_equals_the_per_layer_kernels_under_interpreter():
    run_interpreter_driver(DRIVER, ("context_kv", "context_kv_writer"))


def _args(num_layers=2, tokens=3, width=576):
    kv = torch.zeros(tokens, num_layers * width)
    weights = [torch.ones(512) for _ in range(num_layers)]
    caches = [torch.zeros(2, 4, width) for _ in range(num_layers)]
    slots = [torch.arange(tokens) for _ in range(num_layers)]
    table = torch.zeros(16, 32)
    return dict(kv=kv, norm_weights=weights, eps=1e-6, positions=torch.zeros(tokens, dtype=torch.long),
                cos_cache=table, sin_cache=table, interleaved=True, kv_caches=caches,
                slot_mappings=slots, kv_lora_rank=512)


@pytest.mark.parametrize("bad,match", [
    (dict(kv_caches=[torch.zeros(2, 4, 576)]), "one of each per layer"),
    (dict(kv=torch.zeros(3, 1000)), "kv_lora_rank"),
    (dict(kv_caches=[torch.zeros(2, 4, 600), torch.zeros(2, 4, 600)]), "caches"),
    (dict(positions=torch.zeros(2, dtype=torch.long)), "one position per token"),
])
def test_bad_arguments_are_refused_by_name(bad, match):
    args = _args()
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        write_context_kv_layers(**args)
