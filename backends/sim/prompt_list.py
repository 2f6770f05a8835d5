"""``/v1/completions``' ``prompt`` when it is a list, read as vLLM 0.32's pydantic reads
``list[int] | list[list[int]] | str | list[str]``, and split into prompts as vLLM renders it.
The simulator's one reader of a list prompt: ``/v1/embeddings``' ``input`` is the same
union in vLLM, and ``/tokenize`` counts what ``/v1/completions`` would run.

pydantic tries the union's branches strictly, then laxly, and the first that reads the
value wins: ``["1", 2]`` is two token ids, ``["1", "2"]`` two prompts. When none does,
it reports every branch's errors, branch by branch, each located at the item it could
not read (``body.prompt.1``, ``body.prompt.0.2``), all in one 400 with the other
fields' errors. (Recorded from vLLM 0.32: ``tests/test_sim_multi.py``.)
"""

from __future__ import annotations

from typing import Any

from backends.lax import lax_int
from backends.sim.request_fields import Invalid, Unreadable, integer

LOC = "body.prompt"


def prompts(value: list[Any], loc: str = LOC) -> list[str | list[int]]:
    """The prompts a list holds: one of token ids, or one per string or id list;
    :class:`Unreadable` with pydantic's errors, located at ``loc``, when no branch of the
    union reads it."""
    for strict in (True, False):
        if all(_is_int(item, strict) for item in value):
            # An empty list reads as no ids at all: no prompt (vLLM's renderer).
            return [[_int(item) for item in value]] if value else []
        if all(isinstance(item, list) for item in value) and all(
            _is_int(i, strict) for item in value for i in item
        ):
            return [[_int(i) for i in item] for item in value]
        if all(isinstance(item, str) for item in value):
            return list(value)
    raise Unreadable(*_errors(value, loc))


def _is_int(item: object, strict: bool) -> bool:
    if strict:
        return isinstance(item, int) and not isinstance(item, bool)
    return lax_int(item) is not None


def _int(item: object) -> int:
    number = lax_int(item)
    assert number is not None
    return number


def _errors(value: list[Any], loc: str) -> list[Invalid]:
    """Each branch's errors, in the union's order."""
    errors = [e for i, item in enumerate(value) for e in _int_errors(item, f"{loc}.{i}")]
    for i, item in enumerate(value):
        if not isinstance(item, list):
            errors.append(Invalid("list_type", f"{loc}.{i}", item))
        else:
            errors += [e for j, x in enumerate(item) for e in _int_errors(x, f"{loc}.{i}.{j}")]
    errors.append(Invalid("string_type", loc, value))
    errors += [
        Invalid("string_type", f"{loc}.{i}", item)
        for i, item in enumerate(value)
        if not isinstance(item, str)
    ]
    return errors


def _int_errors(item: object, loc: str) -> list[Invalid]:
    try:
        integer(item, loc)
    except Unreadable as unreadable:
        return list(unreadable.errors)
    return []
