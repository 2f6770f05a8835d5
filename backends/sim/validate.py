"""A generation request's fields, read as vLLM 0.32 reads them.

vLLM validates the body with pydantic in lax mode (``"3"`` and ``3.0`` are the integer
3, ``"false"`` is false), runs its ``mode="before"`` model validators first, and caps the
output to what the context leaves (``get_max_tokens``): a request whose prompt fits is
served, its output cut at the context with finish reason ``length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.lax import lax_bool, lax_int
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens

DEFAULT_MAX_TOKENS = 256  # the simulator's own default (vLLM: whatever the context leaves)


class BadRequest(Exception):
    """What vLLM answers 400, with its message and ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


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
    # The model validators run before any field is read, on the raw values.
    if payload.get("stream_options") and not payload.get("stream"):
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    prompt = payload.get("prompt")
    if not chat and (prompt is None or prompt == "" or prompt == []):
        raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    # Then the fields, each on its own.
    stream = _flag(payload, "stream", nullable=True)
    ignore_eos = _flag(payload, "ignore_eos", nullable=False)
    options = payload.get("stream_options")
    options = {} if options is None else options
    include_usage = lax_bool(options.get("include_usage")) if isinstance(options, dict) else None
    if include_usage is None:
        raise BadRequest("stream_options: invalid", "stream_options")
    # Chat: max_completion_tokens wins; /v1/completions knows only max_tokens.
    fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    requested = {name: _int_field(payload, name) for name in fields}
    param = next((name for name in fields if requested[name] is not None), "max_tokens")
    n = _int_field(payload, "n")
    # Then the prompt is rendered, and the output fitted to the context.
    prompt_tokens = _prompt_tokens(payload, chat)
    max_tokens = _output_budget(max_model_len, prompt_tokens, requested[param], param)
    if n is not None and n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if n is not None and n > 1:
        # One sequence per request is all the cost model knows: say so, never answer
        # with one choice where n were asked.
        raise BadRequest("n > 1 is not supported by the simulator", "n")
    return Asked(prompt_tokens, max_tokens, stream, include_usage, ignore_eos)


def _prompt_tokens(payload: dict[str, Any], chat: bool) -> int:
    try:
        if chat:
            if not isinstance(payload.get("messages"), list):
                raise BadRequest("messages: field required", "messages")
            return count_chat_tokens(payload["messages"])
        prompts = prompts_of(payload["prompt"])
        if len(prompts) > 1:
            # vLLM answers one choice per prompt: the same sequences n > 1 asks for.
            raise BadRequest("a list of prompts is not supported by the simulator", "prompt")
        return tokens_of(prompts[0])
    except (AttributeError, TypeError, UnicodeEncodeError) as exc:
        # A message that is no object, a lone surrogate: vLLM answers these 400 too.
        param = "messages" if chat else "prompt"
        raise BadRequest(f"{param}: invalid: {type(exc).__name__}", param) from None


def _flag(payload: dict[str, Any], name: str, *, nullable: bool) -> bool:
    value = payload.get(name)
    flag = lax_bool(value)
    if flag is None or (value is None and name in payload and not nullable):
        raise BadRequest(f"{name}: Input should be a valid boolean", name)
    return flag


def _int_field(payload: dict[str, Any], name: str) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    number = lax_int(value)
    if number is None:
        raise BadRequest(f"{name}: Input should be a valid integer", name)
    return number


def _output_budget(max_model_len: int, prompt: int, requested: int | None, param: str) -> int:
    """vLLM's ``TokenizeParams`` checks, then ``get_max_tokens``: the output is capped to
    what the context leaves."""
    if requested is not None and requested > max_model_len:
        raise BadRequest(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
        )
    if prompt > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    budget = min(max_model_len - prompt, DEFAULT_MAX_TOKENS if requested is None else requested)
    if budget < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {budget}.", "max_tokens")
    return budget
