"""A generation request's fields, read as vLLM 0.32 reads them.

vLLM refuses a request in four steps, each its own 400, and a client sees which one:

1. its ``mode="before"`` model validators, on the raw body;
2. pydantic in lax mode (``"3"`` and ``3.0`` are the integer 3, ``"false"`` is false),
   which reports every field it cannot read: FastAPI's ``RequestValidationError``, type
   ``Bad Request``, ``param`` the first error's location (``body.max_tokens``);
3. the context (``TokenizeParams``), then ``get_max_tokens``, which caps the output to
   what the context leaves: a request whose prompt fits is served, its output cut at the
   context with finish reason ``length``;
4. ``SamplingParams._verify_args``, in its order.

Steps 1, 3 and 4 raise a ``VLLMValidationError``: type ``BadRequestError``, and, when it
names the parameter, ``param`` is it and the message ends ``(parameter=..., value=...)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.lax import lax_bool, lax_int
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens

DEFAULT_MAX_TOKENS = 256  # the simulator's own default (vLLM: whatever the context leaves)
MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class BadRequest(Exception):
    """What vLLM answers 400: its message, ``param`` and error ``type``."""

    def __init__(
        self, message: str, param: str | None = None, error_type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.error_type = error_type


def _refused(message: str, parameter: str | None = None, value: object = None) -> BadRequest:
    """A ``VLLMValidationError`` as vLLM answers it: its str() names parameter and value."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    extras += [f"value={value}"] if value is not None else []
    said = f"{message} ({', '.join(extras)})" if extras else message
    return BadRequest(_without_paths(said), parameter)


@dataclass(frozen=True, slots=True)
class Asked:
    prompt_tokens: int
    max_tokens: int  # capped to what the context leaves
    stream: bool
    include_usage: bool
    ignore_eos: bool


def prompts_of(prompt: Any) -> list[Any]:
    """The prompts a ``prompt`` (or embeddings ``input``) holds: a string or a list of
    token ids is one; a list of strings or of id lists is one per item."""
    if isinstance(prompt, list) and prompt and all(_is_id(p) for p in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return prompt
    return [prompt]


def tokens_of(prompt: Any) -> int:
    """One prompt's length: a list of token ids counts its ids."""
    if isinstance(prompt, list):
        if not all(_is_id(p) for p in prompt):
            raise TypeError("a prompt is a string or a list of token ids")
        return len(prompt)
    if not isinstance(prompt, str):
        raise TypeError("a prompt is a string or a list of token ids")
    return count_text_tokens(prompt)


def _is_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def read(payload: dict[str, Any], chat: bool, max_model_len: int) -> Asked:
    """Check a completions request as vLLM does, in its order; raises :class:`BadRequest`."""
    _before_validators(payload, chat)
    try:
        fields = _read_fields(payload, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    except _Unreadable as unreadable:
        raise _validation_error(unreadable.errors) from None
    options = fields["stream_options"] or {}
    # Chat: max_completion_tokens wins; /v1/completions knows only max_tokens.
    param = (
        "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    )
    prompt_tokens, exact = _prompt_tokens(payload, chat)
    max_tokens = _output_budget(max_model_len, prompt_tokens, exact, fields[param], param)
    _check_sampling(fields, max_tokens)
    if fields["n"] is not None and fields["n"] > 1:
        # One sequence per request is all the cost model knows: say so, never answer
        # with one choice where n were asked.
        raise BadRequest("n > 1 is not supported by the simulator", "n")
    return Asked(
        prompt_tokens,
        max_tokens,
        bool(fields["stream"]),
        bool(options.get("include_usage")),
        bool(fields["ignore_eos"]),
    )


def _before_validators(payload: dict[str, Any], chat: bool) -> None:
    """vLLM's ``mode="before"`` model validators, on the raw values before any field is
    read; pydantic runs them last defined first."""
    for validator in _CHAT_BEFORE if chat else _COMPLETION_BEFORE:
        validator(payload)


def _messages_iterable(payload: dict[str, Any]) -> None:
    # check_system_message_content_type iterates the messages unguarded: the TypeError
    # becomes vLLM's 400 before pydantic could say that a list was expected.
    messages = payload.get("messages", [])
    if not isinstance(messages, str | list | dict):
        raise BadRequest(f"'{type(messages).__name__}' object is not iterable")


def _stream_options_need_stream(payload: dict[str, Any]) -> None:
    if payload.get("stream_options") and not payload.get("stream"):
        raise _refused("Stream options can only be defined when `stream=True`.", "stream_options")


def _prompt_given(payload: dict[str, Any]) -> None:
    if payload.get("prompt") in (None, ""):
        raise _refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


def _logprob_counts(payload: dict[str, Any], names: tuple[str, str]) -> None:
    """The checks both endpoints make of ``prompt_logprobs`` and their own count."""
    for name in names:
        value = payload.get(name)
        if value is not None and not isinstance(value, int | float):
            raise _refused(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = payload.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if payload.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise _refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        message = "`prompt_logprobs` must be a positive value or -1."
        raise _refused(message, "prompt_logprobs", prompt_logprobs)


def _chat_logprobs(payload: dict[str, Any]) -> None:
    _logprob_counts(payload, ("prompt_logprobs", "top_logprobs"))
    top = payload.get("top_logprobs")
    if top is None:
        return
    if top < 0 and top != -1:
        raise _refused("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
    if (top == -1 or top > 0) and not payload.get("logprobs"):
        message = "when using `top_logprobs`, `logprobs` must be set to true."
        raise _refused(message, "top_logprobs")


def _completion_logprobs(payload: dict[str, Any]) -> None:
    _logprob_counts(payload, ("prompt_logprobs", "logprobs"))
    logprobs = payload.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise _refused("`logprobs` must be a positive value or -1.", "logprobs", logprobs)


_CHAT_BEFORE = (_messages_iterable, _chat_logprobs, _stream_options_need_stream)
_COMPLETION_BEFORE = (_prompt_given, _stream_options_need_stream, _completion_logprobs)


# --- 2. pydantic, lax mode ------------------------------------------------------------

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
    "greater_than_equal": "Input should be greater than or equal to {ge}",
    "less_than_equal": "Input should be less than or equal to {le}",
    "too_long": "List should have at most {max_length} items after validation, not {actual_length}",
}
# vLLM's bounds on an error message (serve/exception_handling/handlers/validation.py).
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


@dataclass(frozen=True, slots=True)
class _Invalid:
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


class _Unreadable(Exception):
    def __init__(self, *errors: _Invalid) -> None:
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


def _integer(value: object, loc: str) -> int:
    number = lax_int(value)
    if number is not None:
        return number
    if isinstance(value, str):
        raise _Unreadable(_Invalid("int_parsing", loc, value))
    if isinstance(value, float):
        kind = "int_from_float" if math.isfinite(value) else "finite_number"
        raise _Unreadable(_Invalid(kind, loc, value))
    raise _Unreadable(_Invalid("int_type", loc, value))


def _number(value: object, loc: str) -> float:
    if isinstance(value, bool | int | float):
        try:
            return float(value)
        except OverflowError:  # an integer past any float
            raise _Unreadable(_Invalid("float_type", loc, value)) from None
    if isinstance(value, str):
        try:
            return float(value)  # "nan" and "inf" too: vLLM refuses them later, by name
        except ValueError:
            raise _Unreadable(_Invalid("float_parsing", loc, value)) from None
    raise _Unreadable(_Invalid("float_type", loc, value))


def _flag(value: object, loc: str) -> bool:
    flag = lax_bool(value)
    if flag is not None and value is not None:
        return flag
    # A string or a whole number it cannot interpret; anything else is no boolean at all.
    readable = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    raise _Unreadable(_Invalid("bool_parsing" if readable else "bool_type", loc, value))


def _seed(value: object, loc: str) -> int:
    seed = _integer(value, loc)
    if seed < _INT64_MIN:
        raise _Unreadable(_Invalid("greater_than_equal", loc, value, {"ge": _INT64_MIN}))
    if seed > _INT64_MAX:
        raise _Unreadable(_Invalid("less_than_equal", loc, value, {"le": _INT64_MAX}))
    return seed


def _stop(value: object, loc: str) -> list[str]:
    """``str | list[str] (at most MAX_STOP_STRINGS) | None``: pydantic reports why each
    branch of the union refused it."""
    if isinstance(value, str):
        return [value]
    not_a_string = _Invalid("string_type", loc, value)
    if not isinstance(value, list):
        raise _Unreadable(not_a_string, _Invalid("list_type", loc, value))
    items = [
        _Invalid("string_type", f"{loc}.{i}", item)
        for i, item in enumerate(value)
        if not isinstance(item, str)
    ]
    if items:
        raise _Unreadable(not_a_string, *items)
    if len(value) > MAX_STOP_STRINGS:
        ctx = {"field_type": "List", "max_length": MAX_STOP_STRINGS, "actual_length": len(value)}
        raise _Unreadable(not_a_string, _Invalid("too_long", loc, value, ctx))
    return value


def _stream_options(value: object, loc: str) -> dict[str, bool | None]:
    if not isinstance(value, dict):
        raise _Unreadable(_Invalid("model_attributes_type", loc, value))
    return _read_fields(value, _STREAM_OPTIONS_FIELDS)


def _messages(value: object, loc: str) -> list[Any]:
    # Each message is counted, and refused if it cannot be, with the prompt (step 3).
    if not isinstance(value, list):
        raise _Unreadable(_Invalid("list_type", loc, value))
    return value


def _prompt(value: object, loc: str) -> Any:
    """A lone value that is neither a string nor a list; the branches of the union that
    refuse it, in their order. A list is read when its prompts are counted (step 3)."""
    if isinstance(value, str | list):
        return value
    branches = ("list_type", "list_type", "string_type", "list_type")
    raise _Unreadable(*(_Invalid(kind, loc, value) for kind in branches))


@dataclass(frozen=True, slots=True)
class _Field:
    """One field of vLLM's request model: how pydantic reads it, and whether ``null``
    is a value (an absent field keeps its default unread)."""

    name: str
    reader: Callable[[object, str], Any]
    nullable: bool = True
    required: bool = False
    prefix: str = "body"


# Each endpoint's fields the simulator reads, in vLLM's declaration order: pydantic
# reports its errors in that order, and ``param`` is the first.
CHAT_FIELDS = (
    _Field("messages", _messages, nullable=False, required=True),
    _Field("frequency_penalty", _number),
    _Field("logprobs", _flag),
    _Field("top_logprobs", _integer),
    _Field("max_tokens", _integer),
    _Field("max_completion_tokens", _integer),
    _Field("n", _integer),
    _Field("presence_penalty", _number),
    _Field("seed", _seed),
    _Field("stop", _stop),
    _Field("stream", _flag),
    _Field("stream_options", _stream_options),
    _Field("temperature", _number),
    _Field("top_p", _number),
    _Field("top_k", _integer),
    _Field("min_p", _number),
    _Field("repetition_penalty", _number),
    _Field("ignore_eos", _flag, nullable=False),
    _Field("min_tokens", _integer, nullable=False),
    _Field("prompt_logprobs", _integer),
)
_STREAM_OPTIONS_FIELDS = (
    _Field("include_usage", _flag, prefix="body.stream_options"),
    _Field("continuous_usage_stats", _flag, prefix="body.stream_options"),
)
COMPLETION_FIELDS = (
    _Field("prompt", _prompt),
    _Field("echo", _flag),
    _Field("frequency_penalty", _number),
    _Field("logprobs", _integer),
    _Field("max_tokens", _integer),
    _Field("n", _integer, nullable=False),
    _Field("presence_penalty", _number),
    _Field("seed", _seed),
    _Field("stop", _stop),
    _Field("stream", _flag),
    _Field("stream_options", _stream_options),
    _Field("temperature", _number),
    _Field("top_p", _number),
    _Field("top_k", _integer),
    _Field("min_p", _number),
    _Field("repetition_penalty", _number),
    _Field("ignore_eos", _flag, nullable=False),
    _Field("min_tokens", _integer, nullable=False),
    _Field("prompt_logprobs", _integer),
)


def _read_fields(payload: dict[str, Any], fields: tuple[_Field, ...]) -> dict[str, Any]:
    """Every field read (None: left out or null), or every error of those that cannot be."""
    read: dict[str, Any] = {}
    errors: list[_Invalid] = []
    for field in fields:
        value = payload.get(field.name)
        if value is None and (field.nullable or field.name not in payload):
            if field.required:
                errors.append(_Invalid("missing", f"{field.prefix}.{field.name}", payload))
            read[field.name] = None
            continue
        try:
            read[field.name] = field.reader(value, f"{field.prefix}.{field.name}")
        except _Unreadable as unreadable:
            errors.extend(unreadable.errors)
    if errors:
        raise _Unreadable(*errors)
    return read


def _validation_error(errors: tuple[_Invalid, ...]) -> BadRequest:
    """vLLM's answer to a ``RequestValidationError``."""
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    lines += [f"  {error}" for error in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    return BadRequest(_without_paths("\n".join(lines)), errors[0].loc, "Bad Request")


def _without_paths(message: str) -> str:
    """vLLM's ``sanitize_message``: a file path in what the client sent is not echoed."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message).strip()


# --- 3. the prompt and the context ------------------------------------------------------


def _prompt_tokens(payload: dict[str, Any], chat: bool) -> tuple[int, bool]:
    """The prompt's length, and whether it is exact: vLLM tokenizes a text at most one
    token past the context, so of a text over it knows only that much."""
    try:
        if chat:
            return count_chat_tokens(payload["messages"]), False
        prompts = prompts_of(payload["prompt"])
        if not prompts:
            raise BadRequest("You must pass at least one prompt")
        if len(prompts) > 1:
            # vLLM answers one choice per prompt: the same sequences n > 1 asks for.
            raise BadRequest("a list of prompts is not supported by the simulator", "prompt")
        return tokens_of(prompts[0]), not isinstance(prompts[0], str)
    except (AttributeError, TypeError, UnicodeEncodeError) as exc:
        # A message that is no object, a lone surrogate: vLLM answers these 400 too.
        param = "messages" if chat else "prompt"
        raise BadRequest(f"{param}: invalid: {type(exc).__name__}", param) from None


def _output_budget(
    max_model_len: int, prompt: int, exact: bool, requested: int | None, param: str
) -> int:
    """vLLM's ``TokenizeParams`` checks, then ``get_max_tokens``: the output is capped to
    what the context leaves."""
    if requested is not None and requested > max_model_len:
        raise _refused(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            requested,
        )
    if prompt > max_model_len:
        shown = prompt if exact else max_model_len + 1
        qualifier = "at least " if shown == max_model_len + 1 else ""
        raise _refused(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{shown} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            shown,
        )
    return min(max_model_len - prompt, DEFAULT_MAX_TOKENS if requested is None else requested)


# --- 4. SamplingParams ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Range:
    """One of ``SamplingParams._verify_args``'s checks. ``says`` is formatted with every
    sampling value; ``named`` when vLLM names the parameter (``param``, and its value in
    the message)."""

    name: str
    holds: Callable[[dict[str, Any]], bool]
    says: str
    named: bool = False


_SAMPLING_CHECKS = (
    _Range("n", lambda v: v["n"] >= 1, "n must be at least 1, got {n}."),
    _Range(
        "presence_penalty",
        lambda v: -2.0 <= v["presence_penalty"] <= 2.0,
        "presence_penalty must be in [-2, 2], got {presence_penalty}.",
    ),
    _Range(
        "frequency_penalty",
        lambda v: -2.0 <= v["frequency_penalty"] <= 2.0,
        "frequency_penalty must be in [-2, 2], got {frequency_penalty}.",
    ),
    _Range(
        "repetition_penalty",
        lambda v: math.isfinite(v["repetition_penalty"]),
        "repetition_penalty must be a finite number, got {repetition_penalty}.",
    ),
    _Range(
        "repetition_penalty",
        lambda v: v["repetition_penalty"] > 0.0,
        "repetition_penalty must be greater than zero, got {repetition_penalty}.",
    ),
    _Range(
        "temperature",
        lambda v: math.isfinite(v["temperature"]),
        "temperature must be a finite number, got {temperature}.",
        named=True,
    ),
    _Range(
        "temperature",
        lambda v: v["temperature"] >= 0.0,
        "temperature must be non-negative, got {temperature}.",
        named=True,
    ),
    _Range(
        "temperature",
        lambda v: v["temperature"] <= 2.0,
        "temperature must be in [0, 2], got {temperature}.",
        named=True,
    ),
    _Range(
        "top_p",
        lambda v: 0.0 < v["top_p"] <= 1.0,
        "top_p must be in (0, 1], got {top_p}.",
        named=True,
    ),
    _Range(  # -1 is quietly accepted as "disabled", like 0
        "top_k",
        lambda v: v["top_k"] >= -1,
        "top_k must be 0 (disable), or at least 1, got {top_k}.",
    ),
    _Range("min_p", lambda v: 0.0 <= v["min_p"] <= 1.0, "min_p must be in [0, 1], got {min_p}."),
    _Range(
        "max_tokens",
        lambda v: v["max_tokens"] >= 1,
        "max_tokens must be at least 1, got {max_tokens}.",
        named=True,
    ),
    _Range(
        "min_tokens",
        lambda v: v["min_tokens"] >= 0,
        "min_tokens must be greater than or equal to 0, got {min_tokens}.",
    ),
    _Range(
        "min_tokens",
        lambda v: v["min_tokens"] <= v["max_tokens"],
        "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
    ),
    _Range("stop", lambda v: all(v["stop"]), "stop cannot contain an empty string."),
    _Range(  # after _verify_args; a temperature under 0.01 was raised to it, so only 0 is
        "n",  # greedy
        lambda v: v["temperature"] != 0.0 or v["n"] == 1,
        "n must be 1 when using greedy sampling, got {n}.",
    ),
)

# What a field left out (or null) samples with: vLLM's defaults.
_SAMPLING_DEFAULTS = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "min_tokens": 0,
    "stop": [],
}


def _check_sampling(fields: dict[str, Any], max_tokens: int) -> None:
    """``SamplingParams._verify_args``, the first check that fails, with the output
    budget as its ``max_tokens``."""
    values = {
        name: default if fields[name] is None else fields[name]
        for name, default in _SAMPLING_DEFAULTS.items()
    }
    values["max_tokens"] = max_tokens
    for check in _SAMPLING_CHECKS:
        if not check.holds(values):
            message = check.says.format(**values)
            if check.named:
                raise _refused(message, check.name, values[check.name])
            raise _refused(message)
