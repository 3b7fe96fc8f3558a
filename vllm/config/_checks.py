"""Shared validators: every failure is a ValueError naming the field, the value and what is allowed."""
from __future__ import annotations

from typing import Iterable


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(field: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or value < 1:
        allowed = "an int >= 1" + (" or None" if optional else "")
        raise ValueError(f"{field}={value!r} is invalid: it must be {allowed}.")


def check_choice(field: str, value, allowed: Iterable[str]) -> str:
    """Return the lower-cased choice, or raise naming the allowed values."""
    allowed = list(allowed)
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{field}={value!r} is invalid: allowed values are {allowed}.")
    return value.lower()
