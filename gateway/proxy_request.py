"""A client's proxied request, read and rewritten for its backend.

Its priority and queue deadline from its headers, the header lines the backend is sent
(from the client's raw ones, no decoding), and a streamed request's body asking the
backend for usage, spliced on rather than re-encoded where it can be.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.lax import lax_bool, lax_int
from backends.replica import Replica
from gateway.errors import InvalidRequest
from gateway.payload import utf8_object
from gateway.relay import HOP_BY_HOP, connection_options
from gateway.settings import PoolConfig
from gateway.upstream_identity import upstream_identity
from policies.admission import Priority

# Client headers that are the gateway's business, not the backend's. ``expect``: the
# gateway has the whole body before it sends upstream, so the backend must not be asked
# to say 100 Continue first.
_NOT_FORWARDED = frozenset(
    name.encode()
    for name in HOP_BY_HOP
    | {"authorization", "accept-encoding", "x-request-id", "content-type", "expect"}
)
# What every proxied request tells its backend: JSON, and a body in clear (the relay
# must read SSE to time it).
_FIXED_FIELDS = b"content-type: application/json\r\naccept-encoding: identity\r\n"
_PRIORITY_HEADER = "x-kneecap-priority"
_QUEUE_WAIT_HEADER = "x-kneecap-max-queue-wait"
_PRIORITIES = {"interactive": Priority.INTERACTIVE, "batch": Priority.BATCH}


@dataclass(slots=True)
class ProxyRequest:
    endpoint: str  # "/v1/chat/completions", ...
    payload: dict[str, Any]
    body: bytes
    headers: Mapping[str, str]
    raw_headers: Sequence[tuple[bytes, bytes]]  # as received, names in lower case
    request_id: str
    started: float  # perf_counter at arrival
    key_priority: str = "interactive"  # the API key's configured class


def request_priority(request: ProxyRequest) -> Priority:
    """The API key's class, or the header's where that is lower: a client may yield to
    others, but a key the operator made ``batch`` cannot make itself ``interactive``."""
    keyed = _PRIORITIES[request.key_priority]
    value = request.headers.get(_PRIORITY_HEADER)
    if value is None:
        return keyed
    priority = _PRIORITIES.get(value.strip().lower())
    if priority is None:
        raise InvalidRequest(
            f"{_PRIORITY_HEADER} must be one of {', '.join(_PRIORITIES)}, got {value!r}",
            code="invalid_priority",
        )
    return max(priority, keyed)


def max_queue_wait(request: ProxyRequest, pool: PoolConfig) -> float:
    """The pool's queue deadline, or the header's within the pool's ceiling."""
    value = request.headers.get(_QUEUE_WAIT_HEADER)
    if value is None:
        return pool.max_queue_wait_s
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise InvalidRequest(
            f"{_QUEUE_WAIT_HEADER} must be a number of seconds >= 0, got {value!r}",
            code="invalid_queue_wait",
        )
    return min(seconds, pool.max_queue_wait_ceiling_s)


def upstream_fields(request: ProxyRequest, replica: Replica, forward_key: bool) -> bytes:
    """The upstream request's header lines, from the client's raw ones (no decoding)."""
    named = connection_options(request.headers.get("connection"))
    dropped = _NOT_FORWARDED | named if named else _NOT_FORWARDED
    lines = [b"%s: %s\r\n" % pair for pair in request.raw_headers if pair[0] not in dropped]
    lines.append(_FIXED_FIELDS)
    identity = upstream_identity(request.raw_headers, request.request_id, replica, forward_key)
    lines += [b"%s: %s\r\n" % pair for pair in identity]
    return b"".join(lines)


_INCLUDE_USAGE = b',"stream_options":{"include_usage":true}}'


def several_sequences(payload: Mapping[str, Any]) -> bool:
    """Whether the stream may interleave several sequences: ``n`` > 1, or a list of
    prompts or of ``prompt_embeds`` (a list of token ids is one prompt).

    ``n`` is read as the engines' pydantic reads an integer in lax mode (``"2"`` and
    ``2.0`` are 2). (The meter also turns to per-sequence timing at the first event of a
    sequence other than the first.)"""
    n = lax_int(payload.get("n"))
    if n is not None and n > 1:
        return True
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return True
    embeds = payload.get("prompt_embeds")  # vLLM: one prompt a tensor, several in a list
    return isinstance(embeds, list) and len(embeds) > 1


def prepare_stream(request: ProxyRequest) -> bool:
    """Ask the backend for usage; returns True when the client did not ask itself.

    An object that leaves ``include_usage`` out does not ask: vLLM (0.32), SGLang and
    OpenAI all default it to false."""
    if request.endpoint == "/v1/embeddings":
        return False
    if "stream_options" not in request.payload:
        body = _as_utf8(request.body)
        if body is not None and (body := body.rstrip()).endswith(b"}"):
            # The body is a JSON object without the key: add it before the closing brace
            # rather than re-encode the whole (possibly long) prompt.
            request.body = body[:-1] + _INCLUDE_USAGE
            return True
    options = request.payload.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return False  # forwarded as sent: the engine's 400 is the client's answer
    include_usage = lax_bool(options.get("include_usage"))
    continuous = lax_bool(options.get("continuous_usage_stats"))
    if include_usage is None or continuous is None:
        return False  # as above: rewritten, the engine would accept what it refuses
    if include_usage:
        return False  # the client asked: the usage chunk is its own
    merged = dict(options, include_usage=True)
    if continuous:
        # Honoured only with include_usage, which the client did not ask for: as asked,
        # it would put usage on every chunk the client gets.
        merged["continuous_usage_stats"] = False
    payload = dict(request.payload, stream_options=merged)
    try:
        request.body = json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (valid as a JSON escape): keep it escaped
        request.body = json.dumps(payload).encode()
    return True


def _as_utf8(body: bytes) -> bytes | None:
    """The body in UTF-8, the encoding of the bytes spliced onto it; None when it cannot be.

    ``json.loads`` accepted UTF-16 and UTF-32 too (RFC 8259 §8.1 lets a receiver); such a
    body, rare, is decoded and re-encoded. UTF-8, with or without a BOM, is kept as is."""
    if utf8_object(body):
        return body
    encoding = json.detect_encoding(body)
    if encoding.startswith("utf-8"):
        return body
    try:
        return body.decode(encoding).encode()
    except UnicodeError:  # a lone surrogate: the payload is re-serialised instead
        return None
