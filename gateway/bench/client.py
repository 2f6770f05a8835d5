"""One streamed request against an OpenAI endpoint, timed on the client side.

Timing reuses the gateway's own stream meter, so "TTFT" means the same thing
on both sides of the gateway: the first SSE event that carries output, not the
first byte and not the role-only first chunk, timed as the bytes arrive (the
client hands each chunk to the meter from the socket's callback). A failed
request ends as a short message on its record; the load generator never
sees an exception.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.bench.h1 import Client, TransportError
from gateway.bench.stats import RequestRecord
from gateway.meter import StreamMeter
from gateway.sse import SSEFramer


class TargetError(Exception):
    """The target cannot be benchmarked; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class ApiUrl:
    api: str  # base of the OpenAI API, ending in /v1
    root: str  # the server root, where vLLM serves /tokenize
    origin: str  # scheme://host:port, what the client connects to
    api_path: str  # ``api`` without the origin
    root_path: str  # ``root`` without the origin

    @classmethod
    def parse(cls, url: str) -> ApiUrl:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise TargetError(f"bad URL {url!r}: expected http://HOST:PORT[/v1]")
        root = base[: -len("/v1")] if base.endswith("/v1") else base
        parts = urlsplit(root)
        try:
            valid = bool(parts.hostname) and (parts.port is None or parts.port > 0)
        except ValueError:  # a port that is not a number, or out of range
            valid = False
        if not valid:
            raise TargetError(f"bad URL {url!r}: expected http://HOST:PORT[/v1]")
        origin = f"{parts.scheme}://{parts.netloc}"
        return cls(root + "/v1", root, origin, parts.path + "/v1", parts.path)


def error_message(status: int, content: bytes) -> str:
    """``HTTP 404: <the server's own message>``, from any common error body."""
    detail = content.decode(errors="replace").strip()
    try:
        body: Any = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            detail = str(err.get("message") or err.get("detail") or detail)
        elif isinstance(err, str):
            detail = err
        elif "detail" in body:
            detail = str(body["detail"])
    line = " ".join(detail.split())[:200]
    return f"HTTP {status}: {line}" if line else f"HTTP {status}"


async def stream_request(
    client: Client,
    path: str,
    body: dict[str, Any],
    *,
    prompt_tokens: int,
    prompt_class: int | None = None,
    on_tokens: Callable[[float], None] = lambda n: None,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    framer = SSEFramer()
    payload = json.dumps(body).encode()
    meter = StreamMeter(started=clock(), clock=clock)
    ended: float | None = None  # when [DONE] arrived: the end of the stream

    def sink(chunk: bytes) -> None:  # called as the bytes arrive: the meter's clock times them
        nonlocal ended
        _, events = framer.feed(chunk)
        if events:
            before = meter.output_events
            meter.observe(events)
            if meter.output_events > before:
                on_tokens(meter.output_events - before)
            if meter.done and ended is None:
                ended = clock()

    error: str | None = None
    try:
        reply = await client.request("POST", path, payload, sink)
        if reply.status >= 400:
            error = error_message(reply.status, reply.body)
    except TransportError as exc:
        error = str(exc)
    end = ended if ended is not None else clock()
    if error is None and meter.upstream_error:
        error = "error event in the stream"
    if error is None and meter.first_output is None:
        # Tokens that decode to no text yet (part of a UTF-8 character) stream no content:
        # only a stream whose usage shows no token at all produced nothing.
        if meter.usage is None or meter.usage.completion_tokens == 0:
            error = "stream ended without output"
    usage = meter.usage
    output = usage.completion_tokens if usage else meter.output_events
    if output > meter.output_events:  # some events carried several tokens
        on_tokens(output - meter.output_events)
    return RequestRecord(
        prompt_tokens=usage.prompt_tokens if usage else prompt_tokens,
        output_tokens=output,
        ttft=meter.ttft if error is None else None,
        e2e=end - meter.started if error is None else None,
        itls=meter.token_gaps() if error is None else (),
        error=error,
        prompt_class=prompt_class,
    )
