"""The block drafters' fused-input Triton kernel compiles for sm_90 on a machine without a GPU,
with the argument types its launcher passes (recorded from real launcher calls on CPU tensors:
Q of DSpark/DFlash, DCP 1/2/4, one or several drafter groups)."""
from __future__ import annotations

import pytest

from tests.utils.block_inputs_cases import random_case, run_write
from tests.utils.triton_aot import compile_recorded, cuda_target, record_launches

triton = pytest.importorskip("triton")


def test_block_draft_inputs_kernel_compiles_for_sm90():
    from vllm.v1.worker.gpu.spec_decode import block_inputs
    cuda_target()
    with record_launches(block_inputs, "_block_draft_inputs_kernel") as rec:
        for seed in range(24):
            case = random_case(seed)
            run_write(case, block_inputs.write_block_inputs_triton)
    assert {kwargs["Q"] for _, kwargs in rec.launches} >= {1, 4, 5}
    # the early draft step's variants (the extra term, the slot-indexed first ids) and the plain
    assert {(kwargs["HAS_EXTRA"], kwargs["HAS_NEXT_ROWS"]) for _, kwargs in rec.launches} == {
        (False, False), (True, False), (False, True), (True, True)}
    compile_recorded(rec, expect_at_least=4)
