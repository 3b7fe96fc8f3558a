from pathlib import Path

import pytest

from tests.utils.triton_interpreter import run_interpreter_driver


@pytest.mark.slow
def test_triton_kernels_equal_torch_under_interpreter():
    """The DCP-length and slot-mapping kernels' logic, executed by Triton's CPU interpreter, equals
    the torch paths. (Compilation for the GPU is covered by the `gpu` tests.)"""
    run_interpreter_driver(Path(__file__).parents[2].joinpath("utils", "triton_interpret_driver.py"))


def test_interpreter_fix_gives_a_splatted_comparison_a_boolean_array(monkeypatch):
    """tests/utils/triton_interpreter_fixes.py: where the interpreter splats a comparison whose
    handle carries the comparands' int32 (Triton 3.9), the wrapped splat returns booleans with
    the same values; a splat of any other type is left as the interpreter made it."""
    np = pytest.importorskip("numpy")
    tl = pytest.importorskip("triton.language")
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from tests.utils import triton_interpreter_fixes

    builder_cls = interpreter.InterpreterBuilder
    # the wrapper is installed on the class: undo it after the test
    monkeypatch.setattr(builder_cls, "create_splat", builder_cls.create_splat)
    calls = []

    def interpreter_splat(self, ret_ty, arg):  # what Triton 3.9 does: the handle's own type
        calls.append(ret_ty)
        data = np.full(ret_ty.shape, arg.data[0], dtype=np.int32)
        return interpreter.TensorHandle(data, tl.int32)

    monkeypatch.setattr(builder_cls, "create_splat", interpreter_splat)
    assert triton_interpreter_fixes.fix_comparison_splat()
    assert not triton_interpreter_fixes.fix_comparison_splat()  # once only
    builder = builder_cls.__new__(builder_cls)
    comparison = interpreter.TensorHandle(np.array([True]), tl.int32)
    got = builder.create_splat(tl.block_type(tl.int1, [4]), comparison)
    assert got.data.dtype == np.bool_ and got.data.tolist() == [True] * 4 and got.dtype == tl.int1
    false = interpreter.TensorHandle(np.array([False]), tl.int32)
    assert builder.create_splat(tl.block_type(tl.int1, [2]), false).data.tolist() == [False] * 2
    # an int32 splat stays int32
    seven = interpreter.TensorHandle(np.array([7], dtype=np.int32), tl.int32)
    kept = builder.create_splat(tl.block_type(tl.int32, [2]), seven)
    assert kept.data.dtype == np.int32 and kept.data.tolist() == [7, 7]
    assert len(calls) == 3
