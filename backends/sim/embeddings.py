"""``POST /v1/embeddings`` as vLLM 0.32 answers it, vectors drawn from the input's hash.

vLLM reads ``input`` as ``/v1/completions``' ``prompt`` (a string or a list of token ids
is one input; a list of either, one each), or ``messages``, one conversation rendered
by the chat template without a generation prompt unless asked. Each input is checked
against the context as a prompt with no output (``TokenizeParams`` with
``max_output_tokens=0``): the same 400 as a completion's prompt over the context.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

from backends.sim import prompt_list, wire
from backends.sim.refusal import BadRequest
from backends.sim.request_fields import Invalid, Unreadable, validation_error
from backends.sim.tokenizer import CHAT_TOKENS_PER_REPLY, count_chat_tokens
from backends.sim.validate import check_context, tokens_of

EMBEDDING_DIM = 16
_ENCODINGS = "'float', 'base64', 'bytes' or 'bytes_only'"  # vLLM's EncodingFormat


def answer(payload: dict[str, Any], model: str, max_model_len: int) -> bytes:
    """The response body; :class:`BadRequest` for what vLLM answers 400."""
    encoding = _encoding(payload)
    if "messages" in payload and "input" not in payload:
        items: list[str | list[int]] = [json.dumps(payload["messages"])]
        counts = [_chat_tokens(payload)]
    else:
        items = _inputs(payload.get("input"))
        counts = [_counted(item) for item in items]
    for item, count in zip(items, counts, strict=True):
        check_context(max_model_len, count, exact=isinstance(item, list))
    if 0 in counts:  # the engine's check, after the renderer's of every input
        raise BadRequest("The decoder prompt cannot be empty")
    data = [
        {"object": "embedding", "embedding": _vector(item, encoding), "index": index}
        for index, item in enumerate(items)
    ]
    total = sum(counts)
    body = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    return wire.dumps(body)


def _encoding(payload: dict[str, Any]) -> str:
    """vLLM's ``encoding_format``. Its binary answers (``bytes``, ``bytes_only``) are not
    simulated."""
    encoding = payload.get("encoding_format", "float")
    if encoding == "float" or encoding == "base64":
        return str(encoding)
    if encoding in ("bytes", "bytes_only"):
        raise BadRequest(
            f"encoding_format={encoding!r} (a binary body) is not simulated by kneecap sim",
            "encoding_format",
        )
    raise validation_error(_encoding_errors(payload, encoding))


def _encoding_errors(payload: dict[str, Any], encoding: object) -> tuple[Invalid, ...]:
    """pydantic's errors for each branch of vLLM's union of embedding requests (text
    input; one conversation; batched conversations; each of those two in ``input``),
    when ``input`` is one string: only the first, for any other request."""
    wrong = Invalid("literal_error", "body.encoding_format", encoding, {"expected": _ENCODINGS})
    given = payload.get("input")
    if not isinstance(given, str) or "messages" in payload:
        return (wrong,)
    no_messages = Invalid("missing", "body.messages", payload)
    return (
        wrong,
        *(wrong, no_messages) * 2,
        *(wrong, no_messages, Invalid("list_type", "body.input", given)),
        *(wrong, no_messages),
        Invalid("sequence_str", "body.input", given, {"type_name": "str"}),
    )


def _inputs(inputs: object) -> list[str | list[int]]:
    if not isinstance(inputs, str | list) or inputs == []:
        raise BadRequest("input: field required", "input")
    if isinstance(inputs, str):
        return [inputs]
    try:
        return prompt_list.prompts(inputs, "body.input")
    except Unreadable as unreadable:
        raise validation_error(unreadable.errors) from None


def _counted(item: str | list[int]) -> int:
    try:
        return tokens_of(item)
    except UnicodeEncodeError as exc:  # a lone surrogate: no text a tokenizer can read
        raise BadRequest(f"input: invalid: {type(exc).__name__}", "input") from None


def _chat_tokens(payload: dict[str, Any]) -> int:
    messages = payload["messages"]
    try:
        if not isinstance(messages, list) or not messages:
            raise TypeError
        counted = count_chat_tokens(messages)
    except (AttributeError, TypeError, UnicodeEncodeError) as exc:
        raise BadRequest(f"messages: invalid: {type(exc).__name__}", "messages") from None
    # An embedding's template adds no assistant turn unless the client asks for one.
    return counted if payload.get("add_generation_prompt") else counted - CHAT_TOKENS_PER_REPLY


def _vector(item: str | list[int], encoding: str) -> list[float] | str:
    text = item if isinstance(item, str) else json.dumps(item)
    digest = hashlib.sha256(text.encode()).digest()
    vector = [round(v / 255.0, 6) for v in digest[:EMBEDDING_DIM]]
    if encoding == "base64":  # vLLM's default embed_dtype and (x86's) native byte order
        return base64.b64encode(struct.pack(f"<{EMBEDDING_DIM}f", *vector)).decode()
    return vector
