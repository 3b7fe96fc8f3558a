"""The common end of a Triton interpreter driver (tests/utils/triton_*_interpret_driver.py):
NO_TRITON where Triton is missing, else each check with one seeded CPU generator, then the
TRITON_INTERPRET_OK line that tests/utils/triton_interpreter.py looks for."""
from __future__ import annotations

from collections.abc import Callable

import torch


def run_checks(has_triton: bool, *checks: Callable[[torch.Generator], None],
               seed: int = 0) -> None:
    if not has_triton:
        print("NO_TRITON")
        return
    gen = torch.Generator().manual_seed(seed)
    for check in checks:
        check(gen)
    print("TRITON_INTERPRET_OK")
