"""Runs the block drafters' fused-input Triton kernel on CPU tensors under TRITON_INTERPRET=1 and
compares it with the brute-force oracle and the torch twin (launched in a subprocess by
test_block_inputs.py: the interpreter is chosen when triton is imported)."""
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from tests.utils.block_inputs_cases import (expected_lowering,  # noqa: E402
                                            expected_writes, observed_writes, random_case,
                                            random_lowering, run_write, untouched_tails)
from vllm.v1.worker.gpu.spec_decode import block_inputs  # noqa: E402


if __name__ == "__main__":
    if not block_inputs.HAS_TRITON:
        print("NO_TRITON")
        sys.exit(0)
    for seed in range(40):
        kernel_case, twin_case = random_case(seed), random_case(seed)
        run_write(kernel_case, block_inputs.write_block_inputs_triton)
        run_write(twin_case, block_inputs.write_block_inputs_torch)
        got = observed_writes(kernel_case)
        assert got == expected_writes(kernel_case), (seed, got, expected_writes(kernel_case))
        assert got == observed_writes(twin_case), seed
        assert untouched_tails(kernel_case), seed
        # with a held plan's lowering fused in: the same writes, and the plan's lengths
        kernel_case, twin_case = random_case(seed), random_case(seed)
        kernel_low, twin_low = random_lowering(kernel_case, seed), random_lowering(twin_case, seed)
        run_write(kernel_case, block_inputs.write_block_inputs_triton, kernel_low)
        run_write(twin_case, block_inputs.write_block_inputs_torch, twin_low)
        assert observed_writes(kernel_case) == expected_writes(kernel_case), seed
        want = expected_lowering(kernel_case, kernel_low)
        assert (kernel_low.ws.tolist(), kernel_low.kv_len_arr.tolist()) == want, seed
        assert (twin_low.ws.tolist(), twin_low.kv_len_arr.tolist()) == want, seed
    print("TRITON_INTERPRET_OK")
