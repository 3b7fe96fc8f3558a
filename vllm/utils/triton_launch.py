"""Launch a hot @triton.jit kernel without Triton's per-call binding, when nothing its compiled
form depends on has changed.

Why: `kernel[grid](*args)` binds every argument in Python, asks Triton's specializer about each
one (dtype, 16-byte alignment, int == 1 or % 16), builds a cache key from the list (including a
`str()` of the options) and looks it up, before the launcher runs. For the ~45 arguments of the
step-preparation kernel that cost 67-87 us of host time per launch on the H100 node in plain
decode, 137 us in a DSpark step, and 75 / 115 us for the draft-metadata kernels
(`row_seq_lens`, `write_block_inputs`; twentieth session, run GC), against 14 us for a
3-argument kernel: several percent of a host-bound decode step each, 4 launches per DSpark step.

What a launch here skips is only the work that re-derives a compiled kernel Triton already
chose. `LeanLaunch` makes its first launch, and the first after any change, through Triton
(`kernel[grid](...)` returns the compiled kernel) and remembers what that choice rested on:
  * every tensor argument's dtype, device and 16-byte alignment (what Triton specializes on;
    the hot kernels take persistent buffers, so the same objects come back and are recognised
    by identity; they are held by weak reference, never kept alive);
  * every other argument by value, except the int parameters the kernel declares
    `do_not_specialize` (their value never enters the compiled form: row and token counts that
    change every step);
  * the constexprs, the device, and that no launch hook is installed (profilers such as
    proton add one; they then see every launch through Triton; an empty hook chain, which
    Triton calls on every launch, calls nothing and is left out).
While all of that holds, later launches call the compiled kernel's launcher directly, with the
argument list Triton itself passes it (every parameter in signature order, constexprs
included: Triton 3.3 and later). Anything else (another tensor object, a specialized int that
changed, a Triton whose kernel objects lack the attributes used here) goes through Triton and,
where it can, re-learns; up to four compiled variants stay learned side by side (one call
site builds the row lengths of a causal and a non-causal group in turn).

Off by default for the kernels a plain decode step launches (`VLLM_LEAN_TRITON_LAUNCH=1`
turns every LeanLaunch on, `=0` every one off); the speculative-only block-input write is lean
by default (`LeanLaunch(..., default=True)`; twenty-sixth session, see block_inputs.py). Why
the others stay off (twentieth session, runs GE/GF on one H100): with it on, the
graphs-vs-eager, exactness, step-preparation, row-length and block-input GPU tests passed, but `test_memory_profile_gpu.py::test_profile_leaves_nothing...` failed in
both runs (32 MiB more held after the profile than weights + buffers; it passed earlier the
same day without this module, with other tests before it in the process, and 32 MiB is
cuBLAS's per-stream workspace on Hopper, so the order may be the cause; not settled: no device
time was left), and the in-process tok/s A/B of tiny DSpark against no drafts was inside the
node's noise. Settle both before turning it on. (Later: the memory-profile failure was the
test's order, not this module, and with every kernel lean the async no-drafts engine lost
4-7 % of tok/s at B=8 in three runs, unexplained, while DSpark engines did not: HB, HG, JC.)
"""
from __future__ import annotations

import operator
import weakref
from typing import Any

import torch

from vllm.utils.env_flags import switch_flag

ENV_FLAG = "VLLM_LEAN_TRITON_LAUNCH"
_MAX_VARIANTS = 4  # compiled variants one LeanLaunch keeps learned


def base_and_offset(view: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view (EAGLE: drafts[:, step - 1]; the packed step output's last column; a graph
    wrapper's CSR arrays inside their packed buffer) as its base tensor plus an element offset,
    for a kernel that takes the two: the pointer's 16-byte alignment, which Triton specialises
    on, then no longer changes with where the view starts. One compiled variant, no JIT in the
    middle of serving."""
    base = view._base
    if base is None or base.dtype != view.dtype:
        base = view
    return base, view.storage_offset() - base.storage_offset()


def lean_launch_enabled(default: bool = False) -> bool:
    """VLLM_LEAN_TRITON_LAUNCH: "1" / "0" turn every LeanLaunch on / off; unset, each kernel
    takes its own `default` (LeanLaunch(kernel, default=...))."""
    return switch_flag(ENV_FLAG, default, "launch hot Triton kernels through their compiled "
                       "launcher while their specialization holds", "every launch through Triton")


_RUNTIME_KNOBS: list = []  # [triton.knobs.runtime] once looked up ([None]: no knobs)


def _hook_active(hook: Any) -> bool:
    """Whether a launch hook would run: Triton 3.6+ keeps a `HookChain` in place of None and
    calls it on every launch (with launch metadata it builds first); an empty chain calls
    nothing, so a launch without it is the same launch. A hook of any other shape counts as
    active."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return not isinstance(calls, list) or len(calls) > 0


def _launch_hooks_installed() -> bool:
    """Whether Triton would hand a launch to a hook (a profiler such as proton): it must then
    go through Triton, which builds the hook's launch metadata. A Triton without `knobs`
    counts as hooked (no lean launches there)."""
    if not _RUNTIME_KNOBS:
        try:
            from triton import knobs
            _RUNTIME_KNOBS.append(knobs.runtime)
        except Exception:  # noqa: BLE001 - an older Triton: its hooks live elsewhere
            _RUNTIME_KNOBS.append(None)
    runtime = _RUNTIME_KNOBS[0]
    return (runtime is None or _hook_active(runtime.launch_enter_hook)
            or _hook_active(runtime.launch_exit_hook))


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_INSTANCES: "weakref.WeakSet[LeanLaunch]" = weakref.WeakSet()


def set_lean_launches(enabled: bool, kernels=None) -> int:
    """Turn lean launches on or off for every LeanLaunch of the process (or those of the
    kernels named in `kernels`) and forget what they learned (an in-process A/B:
    scripts/ab_lean_launch.py). Returns how many it switched."""
    count = 0
    for launch in list(_INSTANCES):
        if kernels is not None and getattr(launch.kernel, "__name__", None) not in kernels:
            continue
        launch.enabled = bool(enabled)
        launch._learned = []
        count += 1
    return count


def launch_counts() -> dict[str, tuple[int, int]]:
    """{kernel name: (lean launches, launches through Triton)} of every LeanLaunch."""
    return {getattr(launch.kernel, "__name__", repr(launch.kernel)):
            (launch.lean_launches, launch.triton_launches) for launch in list(_INSTANCES)}


class LeanLaunch:
    """Launches of one @triton.jit kernel: `launch(grid, *args, **constexprs)` does what
    `kernel[grid](*args, **constexprs)` does (module doc). `args` are the kernel's
    non-constexpr parameters in order, the constexprs by keyword, and the constexpr parameters
    must follow all the others in the kernel's signature."""

    def __init__(self, kernel: Any, enabled: bool | None = None, default: bool = False):
        self.kernel = kernel
        # `enabled` fixes it (tests, A/Bs); else VLLM_LEAN_TRITON_LAUNCH, else `default`
        self.enabled = lean_launch_enabled(default) if enabled is None else enabled
        self.lean_launches = 0     # launches that skipped Triton's binding
        self.triton_launches = 0   # launches through Triton (first, changed, hooked)
        self._learned: list[_Learned] = []
        self._layout = self._parameter_layout(kernel)
        _INSTANCES.add(self)

    @staticmethod
    def _parameter_layout(kernel: Any) -> tuple | None:
        """(number of non-constexpr parameters, their do_not_specialize flags, constexpr
        names in order), or None when the kernel object does not say (no lean launches)."""
        params = getattr(kernel, "params", None)
        if not params:
            return None
        try:
            flags = [(bool(p.is_constexpr), bool(getattr(p, "do_not_specialize", False)),
                      p.name) for p in params]
        except AttributeError:
            return None
        num_args = sum(1 for c, _, _ in flags if not c)
        if any(c for c, _, _ in flags[:num_args]):
            return None  # a constexpr before a runtime parameter: not the supported shape
        return num_args, tuple(d for _, d, _ in flags[:num_args]), tuple(
            n for _, _, n in flags[num_args:])

    def __call__(self, grid: tuple, *args, **constexprs) -> None:
        if self._learned and not _launch_hooks_installed():
            device = _current_device()
            for learned in self._learned:
                if (len(args) == learned.num_args and constexprs == learned.constexprs
                        and learned.device == device and learned.holds(args)):
                    learned.run(grid[0], grid[1] if len(grid) > 1 else 1,
                                grid[2] if len(grid) > 2 else 1, _current_raw_stream(device),
                                learned.function, learned.packed, None, None, None, *args,
                                *learned.const_values)
                    self.lean_launches += 1
                    return
        compiled = self.kernel[grid](*args, **constexprs)
        self.triton_launches += 1
        learned = self._learn(compiled, args, constexprs) if self.enabled else None
        if learned is not None:
            # newest first; a few variants side by side (one call site launching the kernel
            # for two attention groups with other constexprs alternates between them)
            self._learned = [learned] + self._learned[:_MAX_VARIANTS - 1]

    def _learn(self, compiled: Any, args: tuple, constexprs: dict) -> _Learned | None:
        """What the compiled kernel Triton just launched rests on (module doc), or None."""
        layout = self._layout
        if layout is None or compiled is None or _launch_hooks_installed():
            return None
        num_args, no_spec, const_names = layout
        if len(args) != num_args or set(constexprs) != set(const_names):
            return None
        try:
            run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        except Exception:  # noqa: BLE001 - another Triton's kernel object: stay on Triton
            return None
        if not callable(run) or function is None:
            return None
        # Triton 3.3+ hands its launcher every parameter, constexprs included, and its source
        # signature lists them all; an older layout is not what this launches with.
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        if signature is None or len(signature) != num_args + len(const_names):
            return None
        tensor_pos, tensors, value_pos, values, int_pos = [], [], [], [], []
        for i, (arg, skip) in enumerate(zip(args, no_spec)):
            if isinstance(arg, torch.Tensor):
                tensor_pos.append(i)
                tensors.append(arg)
            elif skip and type(arg) is int and _I32_MIN <= arg <= _I32_MAX:
                int_pos.append(i)  # do_not_specialize: its value is not in the compiled kernel
            else:
                value_pos.append(i)
                values.append(arg)
        return _Learned(_current_device(), num_args, dict(constexprs),
                        tuple(constexprs[n] for n in const_names), run, function, packed,
                        _picker(tensor_pos), tuple(tensors), _picker(value_pos), tuple(values),
                        _picker(int_pos), (int,) * len(int_pos))


def _picker(positions: list[int]):
    """A C-level getter of these argument positions that always returns a tuple."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class _Learned:
    """What one compiled kernel rests on, and how to launch it (LeanLaunch._learn). Tensors
    are held by weak reference: a learned launch must not keep an engine's buffers alive."""

    __slots__ = ("device", "num_args", "constexprs", "const_values", "run", "function", "packed",
                 "tensors_of", "refs", "tensor_classes", "values_of", "values", "ints_of",
                 "int_types")

    def __init__(self, device, num_args, constexprs, const_values, run, function, packed,
                 tensors_of, tensors, values_of, values, ints_of, int_types):
        self.device, self.num_args = device, num_args
        self.constexprs, self.const_values = constexprs, const_values
        self.run, self.function, self.packed = run, function, packed
        self.tensors_of = tensors_of
        self.refs = tuple(map(weakref.ref, tensors))
        self.tensor_classes = tuple(map(_tensor_class, tensors))
        self.values_of, self.values = values_of, values
        self.ints_of, self.int_types = ints_of, int_types

    def holds(self, args: tuple) -> bool:
        """Whether Triton would pick the same compiled kernel for `args`: tensors of the same
        dtype, device and 16-byte alignment (the same objects: surely), the same specialized
        values, and where the kernel takes unspecialized ints, ints of the same 32-bit type."""
        now = self.tensors_of(args)
        if not all(map(operator.is_, now, map(_deref, self.refs))):
            if tuple(map(_tensor_class, now)) != self.tensor_classes:
                return False
            self.refs = tuple(map(weakref.ref, now))  # other objects of the same class
        if self.values_of(args) != self.values:
            return False
        ints = self.ints_of(args)
        return not ints or (tuple(map(type, ints)) == self.int_types
                            and min(ints) >= _I32_MIN and max(ints) <= _I32_MAX)


_deref = weakref.ref.__call__


# Triton passes an unspecialized int as i32 when it fits, else as a 64-bit type: learned
# kernels hold only for ints in the i32 range.
_I32_MIN, _I32_MAX = -(2 ** 31), 2 ** 31 - 1


def _tensor_class(t: torch.Tensor) -> tuple:
    """What Triton's specialization reads from a tensor argument: dtype, device and whether
    its data pointer is 16-byte aligned."""
    return t.dtype, t.device, t.data_ptr() % 16 == 0
