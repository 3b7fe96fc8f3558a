"""Corrections to Triton's CPU interpreter (TRITON_INTERPRET=1) that the kernel-check drivers need
on some Triton releases; the interpreter runners (triton_interpret_batch.py) apply them before any
driver runs. Each one touches only the interpreter's Python emulation, never a compiled kernel.

* Splat of a comparison (Triton 3.9): the interpreter keeps the comparands' element type (int32)
  in a comparison's handle although the tensor is int1, and its splat fills the new block with
  that handle type. So `tl.program_id(0) < n` combined with a block mask (`in_block & real`,
  the block-input and step-preparation kernels' row guard) yields an int32 array, and a load or
  store masked by it fails with "mask has unsupported dtype". A splat's type is its `ret_ty`:
  where that is int1 and the filled array is not boolean, the fix converts it (values 0/1).
  Compiled kernels are unaffected (the comparison is an i1 there)."""
from __future__ import annotations

import inspect


def fix_comparison_splat() -> bool:
    """Wrap the interpreter's create_splat as the module says. Returns whether it was wrapped
    (False: no interpreter, already wrapped, or a create_splat of another shape, which is left
    alone so that a later Triton's own code runs unchanged)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    splat = getattr(builder, "create_splat", None)
    handle_type = getattr(interpreter, "TensorHandle", None)
    if splat is None or handle_type is None or getattr(splat, "fixes_int1", False):
        return False
    if list(inspect.signature(splat).parameters) != ["self", "ret_ty", "arg"]:
        return False

    def create_splat(self, ret_ty, arg):
        handle = splat(self, ret_ty, arg)
        element = getattr(ret_ty, "scalar", ret_ty)
        if element == tl.int1 and handle.data.dtype != np.bool_:
            return handle_type(handle.data.astype(np.bool_), tl.int1)
        return handle

    create_splat.fixes_int1 = True
    builder.create_splat = create_splat
    return True


def apply() -> None:
    fix_comparison_splat()
