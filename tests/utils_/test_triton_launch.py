"""vllm/utils/triton_launch.py: a lean launch calls the compiled launcher exactly as Triton would
(the same arguments, in the same order) only while everything the compiled kernel rests on
holds; any change goes back through Triton and re-learns.

CPU: a fake kernel with Triton's interface (`params`, `kernel[grid](...)` returning a compiled
kernel with `run`, `function`, `packed_metadata`, `src.signature`) records both paths. GPU: a
real Triton kernel, lean launches against plain launches."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

import vllm.utils.triton_launch as tl_launch
from vllm.utils.triton_launch import LeanLaunch


class FakeCompiled:
    def __init__(self, kernel, key):
        self.key = key
        self.function = object()
        self.packed_metadata = ("packed", key)
        self.src = SimpleNamespace(signature={p.name: "x" for p in kernel.params})
        self.calls = kernel.direct_calls

    def run(self, *args):
        self.calls.append((self.key, args))


class FakeKernel:
    """Triton's JITFunction as LeanLaunch uses it; compiles one 'kernel' per specialization
    key (dtype + alignment of tensors, value of specialized ints, constexprs)."""

    def __init__(self, names, constexprs=(), no_spec=()):
        self.params = [SimpleNamespace(name=n, is_constexpr=False, do_not_specialize=n in no_spec)
                       for n in names]
        self.params += [SimpleNamespace(name=n, is_constexpr=True, do_not_specialize=False)
                        for n in constexprs]
        self.no_spec = set(no_spec)
        self.triton_calls: list = []
        self.direct_calls: list = []
        self.cache: dict = {}

    def _key(self, args, constexprs):
        key = []
        for p, a in zip(self.params, args):
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            elif p.name in self.no_spec:
                key.append("int32")
            else:
                key.append(a)
        return tuple(key) + tuple(sorted(constexprs.items()))

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            key = self._key(args, constexprs)
            compiled = self.cache.setdefault(key, FakeCompiled(self, key))
            self.triton_calls.append((grid, args, constexprs))
            return compiled
        return launch


class HookChain:
    """Triton 3.6+'s knobs.runtime hooks: a chain called on every launch."""

    def __init__(self):
        self.calls = []


@pytest.fixture
def no_cuda_needed(monkeypatch):
    """The fake kernel's world: device 0, a made-up stream, Triton's empty hook chains (the
    GPU test below runs in the real one)."""
    monkeypatch.setattr(tl_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(tl_launch, "_current_raw_stream", lambda device: 1234)
    runtime = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=None)
    monkeypatch.setattr(tl_launch, "_RUNTIME_KNOBS", [runtime])
    return runtime


def _kernel():
    return FakeKernel(["x", "y", "n", "stride"], constexprs=("BLOCK",), no_spec=("n",))


def test_second_launch_calls_the_compiled_launcher_with_tritons_argument_list(no_cuda_needed):
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    x, y = torch.zeros(8), torch.zeros(8)
    launch((3,), x, y, 5, 16, BLOCK=64)
    launch((4, 2), x, y, 7, 16, BLOCK=64)
    assert len(kernel.triton_calls) == 1 and launch.lean_launches == 1
    (key, args), = kernel.direct_calls
    compiled = kernel.cache[key]
    # grid (padded to 3 dims), stream, function, packed metadata, no launch metadata / hooks,
    # then every parameter in signature order with the constexprs last
    assert args[:9] == (4, 2, 1, 1234, compiled.function, compiled.packed_metadata, None, None,
                        None)
    assert args[9] is x and args[10] is y and args[11:] == (7, 16, 64)


@pytest.mark.parametrize("change", ["specialized int", "constexpr", "dtype", "alignment",
                                    "int out of i32", "arity"])
def test_a_change_the_compiled_kernel_rests_on_goes_through_triton(change, no_cuda_needed):
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    x, y = torch.zeros(8), torch.zeros(8)
    launch((1,), x, y, 5, 16, BLOCK=64)
    args, constexprs = [x, y, 6, 16], {"BLOCK": 64}
    if change == "specialized int":
        args[3] = 17
    elif change == "constexpr":
        constexprs["BLOCK"] = 128
    elif change == "dtype":
        args[0] = torch.zeros(8, dtype=torch.float64)
    elif change == "alignment":
        args[1] = torch.zeros(9)[1:]  # 4 bytes past an aligned start
    elif change == "int out of i32":
        args[2] = 2 ** 31
    elif change == "arity":
        args.append(1)
    launch((1,), *args, **constexprs)
    assert len(kernel.triton_calls) == 2 and not kernel.direct_calls
    assert launch.lean_launches == 0


def test_same_class_tensor_views_stay_lean_and_relearning_follows_a_change(no_cuda_needed):
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    base = torch.zeros(64)
    launch((1,), base[:8], base[16:24], 1, 16, BLOCK=64)
    launch((1,), base[:16], base[32:40], 2, 16, BLOCK=64)  # new views, same class: lean
    assert launch.lean_launches == 1
    launch((1,), base[:8], base[16:24], 3, 32, BLOCK=64)   # another stride: through Triton
    launch((1,), base[:8], base[16:24], 4, 32, BLOCK=64)   # ... learned again: lean
    assert launch.triton_launches == 2 and launch.lean_launches == 2
    assert [k[3] for k, _ in kernel.direct_calls] == [16, 32]  # each launch's own kernel


def test_variants_alternate_lean_and_learned_tensors_are_not_kept_alive(no_cuda_needed):
    # One call site, two attention groups with other constexprs: both variants stay learned.
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    x, y = torch.zeros(8), torch.zeros(8)
    for step in range(4):
        launch((1,), x, y, step, 16, BLOCK=64)
        launch((1,), x, y, step, 16, BLOCK=128)
    assert launch.triton_launches == 2 and launch.lean_launches == 6
    assert {k[-1] for k, _ in kernel.direct_calls} == {("BLOCK", 64), ("BLOCK", 128)}
    # The learned state holds its tensors weakly: an engine's buffers are freed with it.
    ref = weakref.ref(x)
    kernel.triton_calls.clear()  # (the fake's own records of the launches)
    kernel.direct_calls.clear()
    del x
    gc.collect()
    assert ref() is None
    launch((1,), torch.zeros(8), y, 9, 16, BLOCK=64)  # a new tensor of the same class: lean
    assert launch.lean_launches == 7


def test_installed_launch_hooks_disabled_flag_and_unknown_layouts_go_through_triton(
        no_cuda_needed, monkeypatch):
    x, y = torch.zeros(8), torch.zeros(8)
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    launch((1,), x, y, 1, 16, BLOCK=64)
    no_cuda_needed.launch_enter_hook.calls.append(lambda *a: None)  # a profiler's hook
    launch((1,), x, y, 2, 16, BLOCK=64)
    no_cuda_needed.launch_enter_hook = lambda *a: None  # a hook of another shape
    launch((1,), x, y, 3, 16, BLOCK=64)
    assert launch.lean_launches == 0 and launch.triton_launches == 3
    no_cuda_needed.launch_enter_hook = HookChain()  # emptied again: the learned kernel holds
    launch((1,), x, y, 4, 16, BLOCK=64)
    assert launch.triton_launches == 3 and launch.lean_launches == 1
    off = LeanLaunch(kernel, enabled=False)
    for n in range(3):
        off((1,), x, y, n, 16, BLOCK=64)
    assert off.lean_launches == 0 and off.triton_launches == 3
    monkeypatch.delenv(tl_launch.ENV_FLAG, raising=False)
    assert LeanLaunch(kernel).enabled is False  # off by default (the module doc says why)
    assert LeanLaunch(kernel, default=True).enabled is True  # unless the kernel says on
    monkeypatch.setenv(tl_launch.ENV_FLAG, "1")
    assert LeanLaunch(kernel).enabled is True
    monkeypatch.setenv(tl_launch.ENV_FLAG, "0")
    assert LeanLaunch(kernel).enabled is False
    assert LeanLaunch(kernel, default=True).enabled is False  # "0" turns every one off
    monkeypatch.setenv(tl_launch.ENV_FLAG, "2")
    with pytest.raises(ValueError, match="VLLM_LEAN_TRITON_LAUNCH='2' is invalid"):
        LeanLaunch(kernel)
    # a kernel object without parameters, or whose constexprs are not last
    opaque = _kernel()
    launch = LeanLaunch(SimpleNamespace(__getitem__=None), enabled=True)
    assert launch._layout is None
    launch.kernel = opaque  # launches through a kernel whose parameters it could not read
    for n in range(2):
        launch((1,), x, y, n, 16, BLOCK=64)
    assert launch.lean_launches == 0 and len(opaque.triton_calls) == 2
    mixed = FakeKernel(["x", "y", "n", "stride"], constexprs=("BLOCK",))
    mixed.params = mixed.params[-1:] + mixed.params[:-1]
    assert LeanLaunch(mixed, enabled=True)._layout is None


def test_an_older_tritons_launcher_layout_is_not_used(no_cuda_needed):
    # Triton before 3.3 handed its launcher the non-constexpr arguments only; its source
    # signature then lists fewer entries than the parameters.
    kernel = _kernel()
    compiled_init = FakeCompiled.__init__

    def short_signature(self, k, key):
        compiled_init(self, k, key)
        self.src = SimpleNamespace(signature={"x": 0, "y": 0, "n": 0, "stride": 0})
    FakeCompiled.__init__ = short_signature
    try:
        launch = LeanLaunch(kernel, enabled=True)
        x, y = torch.zeros(8), torch.zeros(8)
        for n in range(3):
            launch((1,), x, y, n, 16, BLOCK=64)
    finally:
        FakeCompiled.__init__ = compiled_init
    assert launch.lean_launches == 0 and launch.triton_launches == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lean_launches_of_a_real_kernel_equal_tritons():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n) * scale, mask=i < n)

    launch = LeanLaunch(_scaled_copy, enabled=True)
    src = torch.arange(1000, device="cuda", dtype=torch.float32)
    for n, scale, offset in [(1, 2, 0), (16, 2, 0), (17, 2, 0), (999, 3, 0), (5, 3, 1),
                             (640, 3, 1), (1000, 2, 0)]:
        out = torch.full((1001,), -1.0, device="cuda")
        ref = out.clone()
        view = out[offset:offset + 1000]
        launch((triton.cdiv(n, 128),), src, view, n, scale, BLOCK=128)
        _scaled_copy[(triton.cdiv(n, 128),)](src, ref[offset:offset + 1000], n, scale, BLOCK=128)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), (n, scale, offset)
    assert launch.lean_launches >= 3  # (the same src and a new view of the same class)


@pytest.fixture
def launchers_restored():
    """set_lean_launches switches the process's every LeanLaunch (the engine's module-level
    ones too): put each one's setting back afterwards, for the tests that run later."""
    saved = [(launch, launch.enabled) for launch in list(tl_launch._INSTANCES)]
    yield
    for launch, enabled in saved:
        launch.enabled = enabled


def test_set_lean_launches_switches_every_launcher_and_forgets_what_it_learned(
        no_cuda_needed, launchers_restored):
    kernel = _kernel()
    launch = LeanLaunch(kernel, enabled=True)
    x, y = torch.zeros(8), torch.zeros(8)
    launch((1,), x, y, 1, 16, BLOCK=64)
    assert tl_launch.set_lean_launches(False) >= 1
    launch((1,), x, y, 2, 16, BLOCK=64)  # off: through Triton, nothing learned
    tl_launch.set_lean_launches(True)
    launch((1,), x, y, 3, 16, BLOCK=64)  # on again: learns first ...
    launch((1,), x, y, 4, 16, BLOCK=64)  # ... then lean
    assert (launch.triton_launches, launch.lean_launches) == (3, 1)
    kernel.__name__ = "fake_kernel_counted"
    assert tl_launch.launch_counts()["fake_kernel_counted"] == (1, 3)
    other = LeanLaunch(_kernel(), enabled=True)
    assert tl_launch.set_lean_launches(False, kernels={"fake_kernel_counted"}) == 1
    assert not launch.enabled and other.enabled  # only the named kernel's launcher switched
    tl_launch.set_lean_launches(False)
