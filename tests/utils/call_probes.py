"""Small wrappers tests put around a live engine's objects: count a method's calls, record each
step's accepted drafts, and check an on/off environment switch."""
from __future__ import annotations

import pytest


def count_calls(obj, name: str) -> list[int]:
    """Wrap `obj.name` (an instance attribute from then on) to count its calls; returns the
    one-element counter list, which the caller reads after the run."""
    calls = [0]
    inner = getattr(obj, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def record_accepted(runner) -> list:
    """Wrap the runner's execute_model (synchronous steps) to record, per step, its requests'
    accepted draft counts as sorted (request id, accepted) pairs."""
    accepted = []
    inner = runner.execute_model

    def execute_model(scheduler_output):
        out = inner(scheduler_output)
        accepted.append(sorted(zip(out.req_ids, out.num_accepted_tokens or [])))
        return out

    runner.execute_model = execute_model
    return accepted


def check_switch(monkeypatch, flag: str, enabled, default: bool) -> None:
    """An on/off switch read by `enabled()`: unset gives `default`, "1" / "0" on / off, and
    anything else is refused naming the variable."""
    monkeypatch.delenv(flag, raising=False)
    assert enabled() is default
    monkeypatch.setenv(flag, "1")
    assert enabled() is True
    monkeypatch.setenv(flag, "0")
    assert enabled() is False
    monkeypatch.setenv(flag, "on")
    with pytest.raises(ValueError, match=flag):
        enabled()
