"""Compile a Triton kernel for a CUDA architecture without a GPU (ahead of time, as the GPU node
would at its first launch): a CPU test then catches what only a real launch used to show, e.g.
a loop variable typed int32 in one branch and int64 in another (GPU run A, 2026-11-30).

`record_launches(module, name)` swaps the module's kernel (and its LeanLaunch's) for a recorder
whose launches keep their arguments; `compile_launch(kernel, args, kwargs)` binds those arguments with Triton's own
launch-time specialization for the CUDA backend and compiles the result."""
from __future__ import annotations

from contextlib import contextmanager

import pytest


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
    """Swap `module.name` for a recorder, also inside the module's LeanLaunch objects that launch
    that kernel (vllm/utils/triton_launch.py: they hold the kernel itself, not its name)."""
    from vllm.utils.triton_launch import LeanLaunch
    kernel = getattr(module, name)
    recorder = _Recorder(kernel)
    launchers = [v for v in vars(module).values()
                 if isinstance(v, LeanLaunch) and v.kernel is kernel]
    setattr(module, name, recorder)
    for launcher in launchers:
        launcher.kernel = recorder
    try:
        yield recorder
    finally:
        setattr(module, name, kernel)
        for launcher in launchers:
            launcher.kernel = kernel


# Hopper's largest dynamic shared memory per block (227 KiB): a launch needing more fails at load
# time with OutOfResources, which an ahead-of-time compile would otherwise not show.
SM90_MAX_SHARED = 232448


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int = 90):
    """Compile `kernel` for the launch (args, kwargs) exactly as its first real launch would: the
    arguments go through Triton's own binder for the CUDA backend (tensor -> typed pointer with the
    16-byte alignment attribute, int -> i32/i64 or the constant 1 unless `do_not_specialize`,
    float -> fp32, keyword constexprs and launch options such as num_warps / num_stages).
    Returns Triton's compiled kernel; fails when it would not fit in sm_90 shared memory."""
    import triton
    from triton.compiler import ASTSource
    target = cuda_target(arch)
    backend, launch_kwargs, bound, specialization, options = _bind(kernel, args, kwargs, target)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch_kwargs, bound,
                                                              specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    shared = compiled.metadata.shared
    assert shared <= SM90_MAX_SHARED, (
        f"{kernel.fn.__name__} needs {shared} bytes of shared memory (> {SM90_MAX_SHARED} on sm_90) "
        f"with {kwargs}")
    return compiled


def _bind(kernel, args: tuple, kwargs: dict, target):
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    launch_kwargs = dict(kwargs)
    bound, specialization, options = binder(*args, **launch_kwargs)
    return backend, launch_kwargs, bound, specialization, options


def launch_variant(kernel, args: tuple, kwargs: dict, arch: int = 90) -> str:
    """What Triton's kernel cache keys a launch by (argument specialization and options): two
    launches with the same variant run the same compiled kernel."""
    _, _, _, specialization, options = _bind(kernel, args, kwargs, cuda_target(arch))
    return repr((specialization, sorted(options.items())))


def compile_recorded(recorder, expect_at_least: int = 1) -> dict:
    """Compile every distinct variant (launch_variant) of a recorder's launches once; fails when
    fewer than `expect_at_least` variants were launched (a case list that stopped covering them).
    Returns {variant: compiled kernel}."""
    variants: dict = {}
    for args, kwargs in recorder.launches:
        variants.setdefault(launch_variant(recorder.kernel, args, kwargs), (args, kwargs))
    assert len(variants) >= expect_at_least, (
        f"{recorder.kernel.fn.__name__}: {len(variants)} variants launched, expected >= {expect_at_least}")
    out = {}
    for name, (args, kwargs) in variants.items():
        compiled = compile_launch(recorder.kernel, args, kwargs)
        assert compiled.asm["cubin"], name
        out[name] = compiled
    return out
