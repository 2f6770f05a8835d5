"""One streamed request against an OpenAI endpoint, timed on the client side.

Timing reuses the gateway's own stream meter, so "TTFT" means the same thing
on both sides of the gateway: the first SSE event that carries output, not the
first byte and not the role-only first chunk. Transport failures are mapped
here, once, into a short message on the record; the load generator never sees
an httpx exception.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.bench.stats import RequestRecord
from gateway.meter import StreamMeter
from gateway.sse import SSEFramer


class TargetError(Exception):
    """The target cannot be benchmarked; the message is one line for the user."""


@dataclass(frozen=True, slots=True)
class ApiUrl:
    api: str  # base of the OpenAI API, ending in /v1
    root: str  # the server root, where vLLM serves /tokenize

    @classmethod
    def parse(cls, url: str) -> ApiUrl:
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise TargetError(f"bad URL {url!r}: expected http://HOST:PORT[/v1]")
        if base.endswith("/v1"):
            return cls(base, base[: -len("/v1")])
        return cls(base + "/v1", base)


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


def transport_message(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or unreachable"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    prompt_tokens: int,
    prompt_class: int | None = None,
    on_tokens: Callable[[float], None] = lambda n: None,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    framer = SSEFramer()
    meter = StreamMeter(started=clock(), clock=clock)
    error: str | None = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code >= 400:
                error = error_message(response.status_code, await response.aread())
            else:
                async for chunk in response.aiter_bytes():
                    events = framer.feed(chunk)
                    if events:
                        before = meter.output_events
                        meter.observe(events)
                        if meter.output_events > before:
                            on_tokens(meter.output_events - before)
    except httpx.HTTPError as exc:
        error = transport_message(exc)
    end = clock()
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
