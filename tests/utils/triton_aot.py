"""Compile a Triton kernel for a CUDA architecture without a GPU (ahead of time, as the GPU node
would at its first launch): a CPU test then catches what only a real launch used to show, e.g.
a loop variable typed int32 in one branch and int64 in another (GPU run A, 2026-11-30).

`record_launches(module, name)` swaps the module's kernel for a recorder whose launches keep
their arguments; `compile_launch(kernel, args, kwargs)` builds the launch's signature from those
arguments (tensors -> typed pointers, ints -> i32/i64, keyword constexprs) and compiles it."""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import pytest
import torch

_POINTER = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32",
            torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.bool: "*i1",
            torch.uint8: "*u8", torch.int8: "*i8"}


def cuda_target(arch: int = 90):
    """The Triton target for sm_{arch}; skips the test when this Triton has no CUDA backend."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as error:  # a Triton build without the NVIDIA backend
        pytest.skip(f"Triton has no CUDA backend here ({error})")
    return GPUTarget("cuda", arch, 32)


class _Recorder:
    def __init__(self, kernel):
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
        return launch


@contextmanager
def record_launches(module, name: str):
    recorder = _Recorder(getattr(module, name))
    setattr(module, name, recorder)
    try:
        yield recorder
    finally:
        setattr(module, name, recorder.kernel)


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int = 90):
    """Compile `kernel` for the launch (args, kwargs); returns Triton's compiled kernel."""
    import triton
    from triton.compiler import ASTSource
    names = list(inspect.signature(kernel.fn).parameters)
    values = dict(zip(names, args))
    signature, constexprs = {}, {}
    for name in names:
        if name in kwargs:
            signature[name], constexprs[name] = "constexpr", kwargs[name]
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if not -2**31 <= value < 2**31 else "i32"
        else:
            raise TypeError(f"argument {name!r} of {kernel.fn.__name__}: {type(value).__name__}")
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=cuda_target(arch))
