"""On/off environment switches ("1" / "0") with a default, refused by name when set otherwise."""
from __future__ import annotations

import os


def switch_flag(name: str, default: bool, on: str, off: str) -> bool:
    """The switch `name`: unset -> `default`; "1" / "0" -> on / off; anything else raises a
    ValueError that names the variable, the value and what each setting does (`on`, `off`)."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r} is invalid: use 1 ({on}) or 0 ({off})")
    return value == "1"
