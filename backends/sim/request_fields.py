"""Step 2 of vLLM's checks (see :mod:`.validate`): pydantic in lax mode reading each field
of the request model, every error it cannot read reported as FastAPI's
``RequestValidationError`` (type ``Bad Request``, ``param`` the first error's location).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.lax import lax_bool, lax_int
from backends.sim.refusal import BadRequest, without_paths

MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# pydantic's words for each error type it raises here.
_PYDANTIC_SAYS = {
    "missing": "Field required",
    "int_type": "Input should be a valid integer",
    "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
    "int_from_float": "Input should be a valid integer, got a number with a fractional part",
    "finite_number": "Input should be a finite number",
    "float_type": "Input should be a valid number",
    "float_parsing": "Input should be a valid number, unable to parse string as a number",
    "bool_type": "Input should be a valid boolean",
    "bool_parsing": "Input should be a valid boolean, unable to interpret input",
    "string_type": "Input should be a valid string",
    "list_type": "Input should be a valid list",
    "model_attributes_type": "Input should be a valid dictionary or object to extract fields from",
    "dict_type": "Input should be a valid dictionary",
    "literal_error": "Input should be {expected}",
    "sequence_str": "'{type_name}' instances are not allowed as a Sequence value",
    "greater_than_equal": "Input should be greater than or equal to {ge}",
    "less_than_equal": "Input should be less than or equal to {le}",
    "too_long": "List should have at most {max_length} items after validation, not {actual_length}",
}
# vLLM's bounds on an error message (serve/exception_handling/handlers/validation.py).
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


@dataclass(frozen=True, slots=True)
class Invalid:
    """One error pydantic reports, located as vLLM cleans it (``body.stop.1``)."""

    kind: str
    loc: str
    value: object
    ctx: dict[str, Any] | None = None

    def __str__(self) -> str:
        said: dict[str, Any] = {
            "type": self.kind,
            "loc": self.loc,
            "msg": _PYDANTIC_SAYS[self.kind].format(**(self.ctx or {})),
            "input": _summary(self.value),
        }
        if self.ctx:
            said["ctx"] = self.ctx
        text = str(said)  # vLLM renders each error as the dict's repr
        return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "...[truncated]"


class Unreadable(Exception):
    def __init__(self, *errors: Invalid) -> None:
        super().__init__(errors)
        self.errors = errors


def _summary(value: object) -> str:
    """What vLLM echoes of an input it could not read: never a whole container."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def integer(value: object, loc: str) -> int:
    number = lax_int(value)
    if number is not None:
        return number
    if isinstance(value, str):
        raise Unreadable(Invalid("int_parsing", loc, value))
    if isinstance(value, float):
        kind = "int_from_float" if math.isfinite(value) else "finite_number"
        raise Unreadable(Invalid(kind, loc, value))
    raise Unreadable(Invalid("int_type", loc, value))


def _number(value: object, loc: str) -> float:
    if isinstance(value, bool | int | float):
        try:
            return float(value)
        except OverflowError:  # an integer past any float
            raise Unreadable(Invalid("float_type", loc, value)) from None
    if isinstance(value, str):
        try:
            return float(value)  # "nan" and "inf" too: vLLM refuses them later, by name
        except ValueError:
            raise Unreadable(Invalid("float_parsing", loc, value)) from None
    raise Unreadable(Invalid("float_type", loc, value))


def _flag(value: object, loc: str) -> bool:
    flag = lax_bool(value)
    if flag is not None and value is not None:
        return flag
    # A string or a whole number it cannot interpret; anything else is no boolean at all.
    readable = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    raise Unreadable(Invalid("bool_parsing" if readable else "bool_type", loc, value))


def _seed(value: object, loc: str) -> int:
    seed = integer(value, loc)
    if seed < _INT64_MIN:
        raise Unreadable(Invalid("greater_than_equal", loc, value, {"ge": _INT64_MIN}))
    if seed > _INT64_MAX:
        raise Unreadable(Invalid("less_than_equal", loc, value, {"le": _INT64_MAX}))
    return seed


def _stop(value: object, loc: str) -> list[str]:
    """``str | list[str] (at most MAX_STOP_STRINGS) | None``: pydantic reports why each
    branch of the union refused it."""
    if isinstance(value, str):
        return [value]
    not_a_string = Invalid("string_type", loc, value)
    if not isinstance(value, list):
        raise Unreadable(not_a_string, Invalid("list_type", loc, value))
    items = [
        Invalid("string_type", f"{loc}.{i}", item)
        for i, item in enumerate(value)
        if not isinstance(item, str)
    ]
    if items:
        raise Unreadable(not_a_string, *items)
    if len(value) > MAX_STOP_STRINGS:
        ctx = {"field_type": "List", "max_length": MAX_STOP_STRINGS, "actual_length": len(value)}
        raise Unreadable(not_a_string, Invalid("too_long", loc, value, ctx))
    return value


def _stream_options(value: object, loc: str) -> dict[str, bool | None]:
    if not isinstance(value, dict):
        raise Unreadable(Invalid("model_attributes_type", loc, value))
    return read_fields(value, _STREAM_OPTIONS_FIELDS)


def _string(value: object, loc: str) -> str:
    if not isinstance(value, str):
        raise Unreadable(Invalid("string_type", loc, value))
    return value


def _messages(value: object, loc: str) -> list[Any]:
    # Only the first message no branch reads is reported; a message read here is counted,
    # and refused if it cannot be, with the prompt (step 3).
    if not isinstance(value, list):
        raise Unreadable(Invalid("list_type", loc, value))
    for index, message in enumerate(value):
        if not _is_message(message):
            raise Unreadable(_message_error(message, f"{loc}.{index}"))
    return value


def _is_message(message: object) -> bool:
    """Whether a branch of vLLM's message union reads it: any string ``role`` does (its
    custom-role branch), with a ``content`` that is text, parts or nothing."""
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and not isinstance(message.get("content"), int | float)
    )


def _message_error(message: object, loc: str) -> Invalid:
    """The first of the errors pydantic reports for a message no branch of the union
    reads: its first branch's (a developer message: ``content``, then ``role``). The
    other branches' errors are not reproduced."""
    first = f"{loc}.ChatCompletionDeveloperMessageParam"
    if not isinstance(message, dict):
        return Invalid("dict_type", first, message)
    content = message.get("content", _ABSENT)
    if content is _ABSENT:
        return Invalid("missing", f"{first}.content", message)
    if not isinstance(content, str | list | dict):
        return Invalid("string_type", f"{first}.content", content)
    if "role" not in message:
        return Invalid("missing", f"{first}.role", message)
    return Invalid("literal_error", f"{first}.role", message["role"], {"expected": "'developer'"})


_ABSENT = object()
_FORMAT_TYPES = "'text', 'json_object' or 'json_schema'"


def _tools(value: object, loc: str) -> list[Any]:
    """``list[ChatCompletionToolsParam]``: each an object with a ``function`` object
    that has a string ``name``."""
    if not isinstance(value, list):
        raise Unreadable(Invalid("list_type", loc, value))
    errors = []
    for index, tool in enumerate(value):
        at = f"{loc}.{index}"
        if not isinstance(tool, dict):
            errors.append(Invalid("model_attributes_type", at, tool))
        elif "function" not in tool:
            errors.append(Invalid("missing", f"{at}.function", tool))
        elif not isinstance(function := tool["function"], dict):
            errors.append(Invalid("model_attributes_type", f"{at}.function", function))
        elif "name" not in function:
            errors.append(Invalid("missing", f"{at}.function.name", function))
        elif not isinstance(function["name"], str):
            errors.append(Invalid("string_type", f"{at}.function.name", function["name"]))
    if errors:
        raise Unreadable(*errors)
    return value


def _response_format(value: object, loc: str) -> object:
    """``ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat``:
    pydantic reports why each branch refused it, in that order."""
    if not isinstance(value, dict):
        raise Unreadable(*(Invalid("model_attributes_type", loc, value) for _ in range(3)))
    kind = value.get("type", _ABSENT)
    if kind in ("text", "json_object", "json_schema"):
        return value
    if kind == "structural_tag":
        return value  # its branches' own fields are not simulated
    at = f"{loc}.type"
    if kind is _ABSENT:
        wrong_type = [Invalid("missing", at, value)] * 3
    else:
        wrong_type = [
            Invalid("literal_error", at, kind, {"expected": _FORMAT_TYPES}),
            *[Invalid("literal_error", at, kind, {"expected": "'structural_tag'"})] * 2,
        ]
    structural = [Invalid("missing", f"{loc}.format", value)] if "format" not in value else []
    legacy = [
        Invalid("missing", f"{loc}.{name}", value)
        for name in ("structures", "triggers")
        if name not in value
    ]
    raise Unreadable(wrong_type[0], wrong_type[1], *structural, wrong_type[2], *legacy)


def _prompt(value: object, loc: str) -> Any:
    """A lone value that is neither a string nor a list; the branches of the union that
    refuse it, in their order. A list is read when its prompts are counted (step 3)."""
    if isinstance(value, str | list):
        return value
    branches = ("list_type", "list_type", "string_type", "list_type")
    raise Unreadable(*(Invalid(kind, loc, value) for kind in branches))


@dataclass(frozen=True, slots=True)
class _Field:
    """One field of vLLM's request model: how pydantic reads it, and whether ``null``
    is a value (an absent field keeps its default unread)."""

    name: str
    reader: Callable[[object, str], Any]
    nullable: bool = True
    required: bool = False
    prefix: str = "body"


# The sampling fields both request models end with, in the same order; chat declares
# ``response_format`` and ``tools`` among them.
_PRESENCE_PENALTY = _Field("presence_penalty", _number)
_SAMPLING_UP_TO_TOP_P = (
    _Field("seed", _seed),
    _Field("stop", _stop),
    _Field("stream", _flag),
    _Field("stream_options", _stream_options),
    _Field("temperature", _number),
    _Field("top_p", _number),
)
_SAMPLING_FROM_TOP_K = (
    _Field("top_k", integer),
    _Field("min_p", _number),
    _Field("repetition_penalty", _number),
    _Field("ignore_eos", _flag, nullable=False),
    _Field("min_tokens", integer, nullable=False),
    _Field("prompt_logprobs", integer),
)

# Each endpoint's fields the simulator reads, in vLLM's declaration order: pydantic
# reports its errors in that order, and ``param`` is the first.
CHAT_FIELDS = (
    _Field("messages", _messages, nullable=False, required=True),
    _Field("model", _string),
    _Field("frequency_penalty", _number),
    _Field("logprobs", _flag),
    _Field("top_logprobs", integer),
    _Field("max_tokens", integer),
    _Field("max_completion_tokens", integer),
    _Field("n", integer),
    _PRESENCE_PENALTY,
    _Field("response_format", _response_format),
    *_SAMPLING_UP_TO_TOP_P,
    _Field("tools", _tools),
    *_SAMPLING_FROM_TOP_K,
)
_STREAM_OPTIONS_FIELDS = (
    _Field("include_usage", _flag, prefix="body.stream_options"),
    _Field("continuous_usage_stats", _flag, prefix="body.stream_options"),
)
COMPLETION_FIELDS = (
    _Field("model", _string),
    _Field("prompt", _prompt),
    _Field("echo", _flag),
    _Field("frequency_penalty", _number),
    _Field("logprobs", integer),
    _Field("max_tokens", integer),
    _Field("n", integer, nullable=False),
    _PRESENCE_PENALTY,
    *_SAMPLING_UP_TO_TOP_P,
    *_SAMPLING_FROM_TOP_K,
)


def read_fields(payload: dict[str, Any], fields: tuple[_Field, ...]) -> dict[str, Any]:
    """Every field read (None: left out or null), or every error of those that cannot be."""
    read: dict[str, Any] = {}
    errors: list[Invalid] = []
    for field in fields:
        value = payload.get(field.name)
        if value is None and (field.nullable or field.name not in payload):
            if field.required:
                errors.append(Invalid("missing", f"{field.prefix}.{field.name}", payload))
            read[field.name] = None
            continue
        try:
            read[field.name] = field.reader(value, f"{field.prefix}.{field.name}")
        except Unreadable as unreadable:
            errors.extend(unreadable.errors)
    if errors:
        raise Unreadable(*errors)
    return read


def validation_error(errors: tuple[Invalid, ...]) -> BadRequest:
    """vLLM's answer to a ``RequestValidationError``."""
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    lines += [f"  {error}" for error in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    return BadRequest(without_paths("\n".join(lines)), errors[0].loc, "Bad Request")
