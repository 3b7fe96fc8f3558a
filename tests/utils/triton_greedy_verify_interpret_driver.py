"""Runs the greedy verification kernel (vllm/v1/sample/ops/greedy_verify.py) on CPU tensors under
TRITON_INTERPRET=1 and compares it with its torch twin on random ragged cases. Launched in a
subprocess by tests/v1/sample/test_greedy_verify.py."""
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

try:
    import triton  # noqa: F401
except ImportError:
    print("NO_TRITON")
    raise SystemExit(0)

from tests.utils.greedy_verify_cases import random_greedy_verify_case  # noqa: E402
from vllm.v1.sample.ops import greedy_verify as gv  # noqa: E402

for seed in range(60):
    case = random_greedy_verify_case(seed)
    S = len(case["rows_np"])
    greedy = case["logits"].argmax(-1)
    results = []
    for fn in (gv.greedy_verify_torch, gv.greedy_verify_triton):
        last_sampled, out = case["last_sampled"].clone(), case["out"].clone()
        fn(greedy, case["cu"], case["slots"], case["rows"], case["draft_tokens"], last_sampled,
           out, S)
        results.append((last_sampled, out))
    (ls_ref, out_ref), (ls_got, out_got) = results
    assert torch.equal(out_ref, out_got), (seed, out_ref, out_got)
    assert torch.equal(ls_ref, ls_got), (seed, ls_ref, ls_got)
print("TRITON_INTERPRET_OK")
