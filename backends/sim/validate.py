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
Step 2 is :mod:`.request_fields`, step 4 :mod:`.sampling_checks`; the answers' wording is
:mod:`.refusal`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.sim import prompt_list
from backends.sim.extras import PLAIN, Extras
from backends.sim.refusal import BadRequest, refused
from backends.sim.request_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Unreadable,
    read_fields,
    validation_error,
)
from backends.sim.sampling_checks import check_sampling
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens

# When a request names no output length. /v1/completions: vLLM's 16 (the OpenAI legacy
# API's). Chat: vLLM takes whatever the context leaves, and a real model stops at its EOS;
# the fixed-latency engines draw no EOS, so that would be the whole context every time.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
VOCAB_SIZE = 151_936  # Qwen3's, the profiles' model: what a logprobs of -1 asks for


class EngineRefusal(BadRequest):
    """What vLLM's engine refuses when the request reaches it, after every check of the
    server's: a stream has already begun by then (its answer is an error event)."""

    def __init__(self, refusal: BadRequest, stream: bool) -> None:
        super().__init__(refusal.message, refusal.param, refusal.error_type)
        self.stream = stream


class EmptyPrompt(EngineRefusal):
    """A prompt of a list that is empty."""

    def __init__(self, stream: bool) -> None:
        super().__init__(BadRequest("The decoder prompt cannot be empty"), stream)


@dataclass(frozen=True, slots=True)
class Asked:
    prompt_tokens: int  # the first prompt's: the only one, unless ``prompts`` holds more
    max_tokens: int  # capped to what the context leaves
    stream: bool
    include_usage: bool
    ignore_eos: bool
    n: int = 1
    # Every prompt's (prompt tokens, max_tokens) when a /v1/completions request sent
    # several; empty for one prompt, the path nearly every request takes.
    prompts: tuple[tuple[int, int], ...] = ()
    extras: Extras = PLAIN  # logprobs, echo, continuous usage: what few requests ask

    @property
    def sequences(self) -> int:
        """How many sequences the engine runs: one per (prompt, copy)."""
        return max(1, len(self.prompts)) * self.n


def tokens_of(prompt: str | list[int]) -> int:
    """One prompt's length, as :mod:`.prompt_list` reads it: a list of token ids counts
    its ids."""
    return len(prompt) if isinstance(prompt, list) else count_text_tokens(prompt)


def read(payload: dict[str, Any], chat: bool, max_model_len: int) -> Asked:
    """Check a completions request as vLLM does, in its order; raises :class:`BadRequest`."""
    _before_validators(payload, chat)
    listed, unread = _listed_prompts(payload, chat)
    try:
        fields = read_fields(payload, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    except Unreadable as unreadable:
        # the prompt is the second field, after the model
        model = tuple(e for e in unreadable.errors if e.loc == "body.model")
        rest = unreadable.errors[len(model) :]
        raise validation_error((*model, *unread, *rest)) from None
    if unread:
        raise validation_error(unread)
    options = fields["stream_options"] or {}
    # Chat: max_completion_tokens wins; /v1/completions knows only max_tokens.
    param = (
        "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    )
    default = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    requested = fields[param]
    n = fields["n"] or 1
    stream, usage, ignore_eos = (
        bool(fields["stream"]),
        bool(options.get("include_usage")),
        bool(fields["ignore_eos"]),
    )
    if listed is not None:
        budgets = _listed_budgets(listed, fields, max_model_len, requested, param, default)
        prompts = tuple(budgets) if len(budgets) > 1 else ()
        extras = _extras(fields, chat, [p if isinstance(p, str) else "" for p in listed])
        return Asked(*budgets[0], stream, usage, ignore_eos, n, prompts, extras)
    prompt_tokens = _prompt_tokens(payload, chat)
    max_tokens = _output_budget(max_model_len, prompt_tokens, False, requested, param, default)
    _check_n(n)
    check_sampling(fields, max_tokens)
    extras = _extras(fields, chat, [] if chat else [payload["prompt"]])
    return Asked(prompt_tokens, max_tokens, stream, usage, ignore_eos, n, extras=extras)


def _sample_logprobs(fields: dict[str, Any], chat: bool) -> int | None:
    """The sampling parameters' ``logprobs``, as the engine checks them when the request
    reaches it (``SamplingParams._validate_logprobs``), before it looks at the prompt."""
    logprobs = fields["logprobs"]
    if chat:
        logprobs = fields["top_logprobs"] if logprobs else None
    if logprobs:
        asked = VOCAB_SIZE if logprobs == -1 else logprobs
        if asked > MAX_LOGPROBS:
            said = f"Requested sample logprobs of {asked}, which is greater than max allowed: "
            refusal = refused(said + str(MAX_LOGPROBS), "logprobs", asked)
            raise EngineRefusal(refusal, bool(fields["stream"]))
    return logprobs


def _extras(fields: dict[str, Any], chat: bool, prompts: list[str]) -> Extras:
    """What the request asks besides its tokens. A prompt of token ids echoes as nothing:
    the simulator has no vocabulary to decode them with."""
    logprobs = _sample_logprobs(fields, chat)
    echo = tuple(prompts) if not chat and fields["echo"] else ()
    if chat and logprobs is None and fields["logprobs"]:
        logprobs = 0  # logprobs without top_logprobs: each token's own, no alternatives
    options = fields["stream_options"] or {}
    continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
    if logprobs is None and not echo and not continuous:
        return PLAIN
    return Extras(logprobs, echo, continuous)


def _listed_budgets(
    listed: list[str | list[int]],
    fields: dict[str, Any],
    max_model_len: int,
    requested: int | None,
    param: str,
    default: int,
) -> list[tuple[int, int]]:
    """Each prompt's (prompt tokens, max_tokens), checked in vLLM's order: every prompt
    against the context as it is rendered, then each one's sampling parameters, then the
    engine's own check of each prompt."""
    if not listed:
        raise BadRequest("You must pass at least one prompt")
    budgets = []
    for prompt in listed:
        try:
            tokens = tokens_of(prompt)
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise BadRequest(f"prompt: invalid: {type(exc).__name__}", "prompt") from None
        # vLLM tokenizes a text at most one token past the context: of a text over it, it
        # knows only that much; of token ids, their count.
        exact = not isinstance(prompt, str)
        budgets.append(
            (tokens, _output_budget(max_model_len, tokens, exact, requested, param, default))
        )
    _check_n(fields["n"] or 1)
    # Only max_tokens differs between the prompts' checks: each distinct one is checked.
    for max_tokens in dict.fromkeys(budget for _, budget in budgets):
        check_sampling(fields, max_tokens)
    _sample_logprobs(fields, False)
    if any(tokens == 0 for tokens, _ in budgets):
        raise EmptyPrompt(bool(fields["stream"]))
    return budgets


def _check_n(n: int) -> None:
    # SamplingParams checks it right after n >= 1 (which check_sampling makes), before
    # anything else: an n over it fails there first.
    if n > MAX_N:
        raise refused(
            f"n must be at most {MAX_N}, got {n}. "
            "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
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


_NAMED_TOOL = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _tool_usage(payload: dict[str, Any]) -> None:
    """``check_tool_usage``: a ``tool_choice`` other than "none" needs ``tools``, and a
    named one must name one of them."""
    tools = payload.get("tools")
    if tools == []:
        raise refused(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    choice = payload.get("tool_choice")
    if choice is None or choice == "none":
        return
    if tools is None:
        raise refused("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required"):
        return
    if not isinstance(choice, dict):
        said = f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
        raise refused(said + '"required" are supported.', "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        said = f"Invalid value for `function`: `{function}` in `tool_choice`! "
        raise refused(said + _NAMED_TOOL, "tool_choice.function")
    if "name" not in function:
        said = "Expected field `name` in `function` in `tool_choice`! "
        raise refused(said + _NAMED_TOOL, "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        said = f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
        raise refused(said + _NAMED_TOOL, "tool_choice.function.name")
    try:  # vLLM indexes each tool unguarded, up to the match: its TypeError is a 400
        matched = any(tool["function"]["name"] == name for tool in tools)
    except TypeError as exc:
        raise BadRequest(str(exc)) from None
    if not matched:
        message = "The tool specified in `tool_choice` does not match any of the specified `tools`"
        raise refused(message, "tool_choice")


def _stream_options_need_stream(payload: dict[str, Any]) -> None:
    if payload.get("stream_options") and not payload.get("stream"):
        raise refused("Stream options can only be defined when `stream=True`.", "stream_options")


def _json_schema_given(payload: dict[str, Any]) -> None:
    response_format = payload.get("response_format")
    if (
        isinstance(response_format, dict)
        and response_format.get("type") == "json_schema"
        and response_format.get("json_schema") is None
    ):
        message = (
            "When response_format type is 'json_schema', the 'json_schema' field must be provided."
        )
        raise refused(message, "response_format")


def _prompt_given(payload: dict[str, Any]) -> None:
    if payload.get("prompt") in (None, ""):
        raise refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


def _logprob_counts(payload: dict[str, Any], names: tuple[str, str]) -> None:
    """The checks both endpoints make of ``prompt_logprobs`` and their own count."""
    for name in names:
        value = payload.get(name)
        if value is not None and not isinstance(value, int | float):
            raise refused(f"`{name}` must be an integer.", name, value)
    prompt_logprobs = payload.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if payload.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        message = "`prompt_logprobs` must be a positive value or -1."
        raise refused(message, "prompt_logprobs", prompt_logprobs)


def _chat_logprobs(payload: dict[str, Any]) -> None:
    _logprob_counts(payload, ("prompt_logprobs", "top_logprobs"))
    top = payload.get("top_logprobs")
    if top is None:
        return
    if top < 0 and top != -1:
        raise refused("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
    if (top == -1 or top > 0) and not payload.get("logprobs"):
        message = "when using `top_logprobs`, `logprobs` must be set to true."
        raise refused(message, "top_logprobs")


def _completion_logprobs(payload: dict[str, Any]) -> None:
    _logprob_counts(payload, ("prompt_logprobs", "logprobs"))
    logprobs = payload.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise refused("`logprobs` must be a positive value or -1.", "logprobs", logprobs)


_CHAT_BEFORE = (
    _messages_iterable,
    _tool_usage,
    _chat_logprobs,
    _stream_options_need_stream,
    _json_schema_given,
)
_COMPLETION_BEFORE = (_prompt_given, _stream_options_need_stream, _completion_logprobs)


# --- 3. the prompt and the context ------------------------------------------------------


def _listed_prompts(
    payload: dict[str, Any], chat: bool
) -> tuple[list[str | list[int]] | None, tuple[Any, ...]]:
    """A list ``prompt``'s prompts (None: no list), or pydantic's errors reading it."""
    prompt = payload.get("prompt")
    if chat or not isinstance(prompt, list):
        return None, ()
    try:
        return prompt_list.prompts(prompt), ()
    except Unreadable as unreadable:
        return None, unreadable.errors


def _prompt_tokens(payload: dict[str, Any], chat: bool) -> int:
    """The one prompt's length: the messages' (and tools'), or a string's."""
    try:
        if chat:
            return count_chat_tokens(payload["messages"], payload.get("tools"))
        return count_text_tokens(payload["prompt"])
    except (AttributeError, TypeError, UnicodeEncodeError) as exc:
        # A message that is no object, a lone surrogate: vLLM answers these 400 too.
        param = "messages" if chat else "prompt"
        raise BadRequest(f"{param}: invalid: {type(exc).__name__}", param) from None


def _output_budget(
    max_model_len: int, prompt: int, exact: bool, requested: int | None, param: str, default: int
) -> int:
    """vLLM's ``TokenizeParams`` checks, then ``get_max_tokens``: the output is capped to
    what the context leaves."""
    if requested is not None and requested > max_model_len:
        raise refused(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            requested,
        )
    check_context(max_model_len, prompt, exact)
    return min(max_model_len - prompt, default if requested is None else requested)


def check_context(max_model_len: int, prompt: int, exact: bool) -> None:
    """``TokenizeParams``' length check of a prompt. vLLM tokenizes a text at most one
    token past the context: of a text over it, it knows only that much."""
    if prompt > max_model_len:
        shown = prompt if exact else max_model_len + 1
        qualifier = "at least " if shown == max_model_len + 1 else ""
        raise refused(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {qualifier}{shown} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            shown,
        )
