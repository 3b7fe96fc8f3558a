"""vllm/utils/env_flags.py: the on/off environment switches."""
import pytest

from vllm.utils.env_flags import switch_flag

NAME = "VLLM_TEST_SWITCH_FLAG"


@pytest.mark.parametrize("default", [True, False])
def test_unset_is_the_default_and_0_1_set_it(monkeypatch, default):
    monkeypatch.delenv(NAME, raising=False)
    assert switch_flag(NAME, default, "on", "off") is default
    monkeypatch.setenv(NAME, "1")
    assert switch_flag(NAME, default, "on", "off") is True
    monkeypatch.setenv(NAME, "0")
    assert switch_flag(NAME, default, "on", "off") is False


@pytest.mark.parametrize("value", ["yes", "", "2", "true"])
def test_other_values_are_refused_with_both_settings_named(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ValueError, match=rf"{NAME}={value!r} is invalid: use 1 \(does a\) or "
                                         r"0 \(does b\)"):
        switch_flag(NAME, True, "does a", "does b")
