"""A flag or a count as vLLM and SGLang read it: pydantic in lax mode.

The gateway must read a client's ``stream_options`` flags and its ``n`` the way the engine
will, or it asks for usage the client already asked for, makes valid what the engine
refuses, or times several sequences as one; the simulator reads them the same way to
stand in for the engine.
"""

from __future__ import annotations

import math
import re

# The strings pydantic reads as a bool (case-insensitive); any other string it refuses.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: object) -> bool | None:
    """The flag as the engine reads it (null: off); None when the engine cannot read it
    and will refuse the request."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int | float) and value in (0, 1):
        return value == 1
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
    return None


_DECIMAL = re.compile(r"\s*([+-]?\d+)\.0*\s*")


def lax_int(value: object) -> int | None:
    """An integer field as pydantic reads it in lax mode; None when it would refuse it."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            whole = _DECIMAL.fullmatch(value)  # "3.0": a number with no fraction
            return int(whole.group(1)) if whole else None
    return None
