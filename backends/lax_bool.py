"""A flag as vLLM and SGLang read it: pydantic in lax mode.

The gateway must read a client's ``stream_options`` flags the way the engine will, or it
asks for usage the client already asked for, or makes valid what the engine refuses; the
simulator reads them the same way to stand in for the engine.
"""

from __future__ import annotations

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
