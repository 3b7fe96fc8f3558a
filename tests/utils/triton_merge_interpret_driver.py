"""Runs the Triton LSE-merge kernel on CPU tensors under TRITON_INTERPRET=1 and compares it
with the torch path. Launched in a subprocess by test_dcp_combine_triton_interpreter.py (the
interpreter must be chosen before the kernel is decorated, i.e. at import time)."""
import math
import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from vllm.v1.attention.ops import dcp_combine  # noqa: E402

if not dcp_combine.HAS_TRITON:
    print("NO_TRITON")
    raise SystemExit(0)

gen = torch.Generator().manual_seed(0)
for n, tokens, heads, d in [(2, 3, 4, 512), (3, 2, 5, 64), (8, 1, 2, 512)]:
    out = torch.randn(tokens, heads, d, generator=gen)
    lses = torch.randn(n, tokens, heads, generator=gen) * 4
    lses[0, 0, 0] = float("nan")
    lses[:, 0, 1] = float("-inf")        # all-empty row
    lses[n - 1, -1, -1] = float("inf")
    out[0, 1] = float("nan")              # garbage O of the all-empty row
    for base_e in (True, False):
        feed = lses if base_e else lses / math.log(2.0)
        for rank in range(n):
            ref_o, ref_l = dcp_combine.correct_attn_out_torch(out, feed, rank, base_e)
            got_o, got_l = dcp_combine.correct_attn_out_triton(out, feed, rank, base_e)
            torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_l, ref_l.float(), rtol=1e-5, atol=1e-6)
            assert not torch.isnan(got_o).any()
print("TRITON_INTERPRET_OK")
