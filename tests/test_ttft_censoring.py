"""Streams that end before their first token still tell the window something.

A client that gives up waiting, an upstream read that times out, a backend that fails:
each ends a stream with no TTFT, only the knowledge that it was longer than the wait.
The window used to drop them, so past the knee it saw only the survivors and its p95
looked fine. Now each is a censored TTFT (see ``gateway.window``). Through the recorder
alone, then through a real gateway in front of a real simulator that is too slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from gateway.meter import StreamMeter
from gateway.recording import Flight
from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    served,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)
from tests.test_proxy_wire import records
from tests.test_recording import make

T = TypeVar("T")

# --- the recorder's rule ------------------------------------------------------


def streamed_flight(*, sent: bool = True, stream: bool = True) -> Flight:
    return Flight(
        pool="default",
        model="m",
        stream=stream,
        started=99.0,
        admitted=99.5,
        sent=99.6 if sent else 0.0,
    )


@pytest.mark.parametrize("status", ["client_closed", "upstream_timeout", "upstream_error"])
def test_a_stream_ended_before_its_first_token_is_a_censored_ttft(status: Any) -> None:
    recorder, clock, replica, _ = make(settle_s=None)
    clock.now = 102.0
    recorder.finished(streamed_flight(), replica, status)  # no answer head: no meter
    meter = StreamMeter(started=99.0, window=replica.window, admitted=99.5)
    recorder.finished(streamed_flight(), replica, status, meter=meter)  # a head, no output
    stats = replica.window.stats(102.0)
    assert (stats.ttft_samples, stats.ttft_censored) == (2, 2)
    assert stats.ttft_p95 == 2.5  # from admission to the end, not from receipt


@pytest.mark.parametrize(
    ("status", "sent", "stream"),
    [
        ("ok", True, True),  # answered, in time, with nothing to say
        ("client_error", True, True),  # the backend refused the request itself
        ("client_closed", False, True),  # never reached the backend
        ("upstream_error", True, False),  # not streamed: no TTFT at all
    ],
)
def test_ends_that_bound_no_ttft_add_none(status: Any, sent: bool, stream: bool) -> None:
    recorder, clock, replica, _ = make(settle_s=None)
    clock.now = 102.0
    recorder.finished(streamed_flight(sent=sent, stream=stream), replica, status)
    stats = replica.window.stats(102.0)
    assert (stats.ttft_samples, stats.ttft_censored, stats.ttft_p95) == (0, 0, None)


def test_a_stream_with_output_is_observed_not_censored() -> None:
    recorder, clock, replica, _ = make(settle_s=None)
    clock.now = 102.0
    meter = StreamMeter(started=99.0, window=replica.window, admitted=99.5, clock=lambda: 100.0)
    meter.observe([b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}'])
    recorder.finished(streamed_flight(), replica, "client_closed", meter=meter)
    stats = replica.window.stats(102.0)
    assert (stats.ttft_samples, stats.ttft_censored, stats.ttft_p95) == (1, 0, 0.5)


# --- through a real gateway ------------------------------------------------------

SIM_TTFT_S = 30.0  # far longer than anyone here waits
GIVE_UP_S = 0.3
CLIENTS = 6  # more than the controller's minimum of TTFTs (gateway.control)


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(
        start_sim(tmp_path_factory.mktemp("censoring"), ttft_ms=SIM_TTFT_S * 1000, itl_ms=5)
    )


def gateway_for(tmp_path: Path, sim: Proc, read_timeout_s: float) -> Gateway:
    """A gateway of its own: a backend window nothing else has fed."""
    config = {
        "backends": [backend("slow", sim.url)],
        "health": {"interval_s": 30, "failure_threshold": 1000},
        "upstream": {"read_timeout_s": read_timeout_s, "max_attempts": 1},
        # Long enough that a slow machine reads the samples before the window drops them.
        "measurement": {"window_s": 120},
    }
    return start_gateway(tmp_path, config)


async def open_stream(client: openai.AsyncOpenAI, request_id: str) -> Any:
    return await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        max_tokens=4,
        extra_headers={"x-request-id": request_id},
    )


async def give_up(client: openai.AsyncOpenAI, request_id: str) -> float:
    """Streams one request and gives up on its first token ``GIVE_UP_S`` after the
    answer's head came; returns how long it waited from the head to giving up."""
    stream = await open_stream(client, request_id)
    headed = time.perf_counter()

    async def first_token() -> None:
        async for chunk in stream:  # vLLM's first chunk carries the role only
            assert not (chunk.choices and chunk.choices[0].delta.content), "too fast"

    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first_token(), GIVE_UP_S)
        waited = time.perf_counter() - headed  # before the close the gateway will see
    finally:
        await stream.close()
    return waited


def recorded(gw: Gateway, ids: set[str]) -> list[dict[str, Any]]:
    """The requests' records, once all are in (the recorder batches a request's end)."""
    found: list[dict[str, Any]] = []

    def all_in() -> bool:
        found[:] = [r for r in records(gw) if r["request_id"] in ids]
        return len(found) == len(ids)

    wait_until(all_in, timeout=10)
    return found


def window_of(gw: Gateway) -> dict[str, Any]:
    (state,) = gw.state()["backends"]
    return state["window"]


def run_clients(
    tmp_path: Path,
    sim: Proc,
    read_timeout_s: float,
    each: Callable[[openai.AsyncOpenAI, str], Awaitable[T]],
    status: str,
) -> tuple[list[T], dict[str, Any]]:
    """``CLIENTS`` streams through a gateway of their own, each run by ``each``; all must
    end with ``status``. Returns what each returned, and the backend's window, which must
    hold only censored TTFTs, one a stream."""
    gw = gateway_for(tmp_path, sim, read_timeout_s=read_timeout_s)
    ids = {f"{status}-{i}" for i in range(CLIENTS)}

    async def clients() -> list[T]:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="x", max_retries=0
        ) as client:
            return await asyncio.gather(*(each(client, i) for i in sorted(ids)))

    try:
        results = asyncio.run(clients())
        assert {r["status"] for r in recorded(gw, ids)} == {status}
        window = window_of(gw)
    finally:
        gw.proc.stop()
    assert window["ttft_p95"] is not None, f"only survivors counted: {window}"
    assert window["ttft_censored"] == window["ttft_samples"] == CLIENTS
    return results, window


def test_clients_that_give_up_before_the_first_token_raise_the_windows_ttft(
    tmp_path: Path, slow_sim: Proc
) -> None:
    waited, window = run_clients(tmp_path, slow_sim, 60, give_up, "client_closed")
    # The gateway admitted each request before its head reached the client and saw the
    # close after the client made it: its bound is at least what the client waited.
    assert max(waited) <= window["ttft_p50"] <= window["ttft_p95"] < SIM_TTFT_S


def test_streams_the_upstream_read_timeout_cut_raise_the_windows_ttft(
    tmp_path: Path, slow_sim: Proc
) -> None:
    read_timeout_s = 0.3
    _, window = run_clients(tmp_path, slow_sim, read_timeout_s, read_to_the_end, "upstream_timeout")
    assert read_timeout_s <= window["ttft_p95"] < SIM_TTFT_S


async def read_to_the_end(client: openai.AsyncOpenAI, request_id: str) -> None:
    """Streams one request to whatever end the gateway gives it."""
    stream = await open_stream(client, request_id)
    try:
        with pytest.raises(openai.APIError):
            async for chunk in stream:
                assert not (chunk.choices and chunk.choices[0].delta.content), "too fast"
    finally:
        await stream.close()


def scripted(tmp_path: Path, endpoint: str, request: dict[str, Any]) -> tuple[int, Any, Any]:
    """One streamed request through a gateway of its own to a raw backend that plays the
    request's script: the answer's status, its record, and the backend's window."""
    raw = start_raw_sse(tmp_path)
    try:
        config = {
            "backends": [backend("raw", raw.url)],
            "health": {"interval_s": 30, "failure_threshold": 1000},
            "upstream": {"max_attempts": 1},
            "measurement": {"window_s": 120},
        }
        gw = start_gateway(tmp_path, config)
        try:
            status = 0
            with contextlib.suppress(httpx.HTTPError):  # a cut body ends the read
                with httpx.stream(
                    "POST",
                    gw.url + endpoint,
                    json={"model": MODEL, "stream": True, **request},
                    headers={"x-request-id": "scripted"},
                    timeout=30,
                ) as answer:
                    status = answer.status_code
                    for _ in answer.iter_raw():
                        pass
            (record,) = recorded(gw, {"scripted"})
            return status, record, window_of(gw)
        finally:
            gw.proc.stop()
    finally:
        raw.stop()


def test_an_error_answered_to_a_stream_is_no_censored_ttft(tmp_path: Path) -> None:
    """A streamed request its only backend answers with a 500: answered, whole. No first
    token was coming, so the wait bounds none (it would read as a long TTFT otherwise)."""
    text = json.dumps({"error": {"message": "boom", "type": "internal", "code": 500}})
    head = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    script = [["send", f"{head}content-length: {len(text)}\r\n\r\n{text}"]]
    request = {"messages": [{"role": "user", "content": "x"}], "raw_script": script}
    status, record, window = scripted(tmp_path, "/v1/chat/completions", request)
    assert (status, record["status"]) == (500, "upstream_error")
    assert (window["ttft_censored"], window["ttft_p95"]) == (0, None)


def test_a_stream_that_is_no_event_stream_is_no_censored_ttft(tmp_path: Path) -> None:
    """An NDJSON answer is relayed unmetered: its output is never seen, so a cut after it
    must not read as a first token still awaited (the whole stream's length, as a TTFT)."""
    head = (
        "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    )
    line = json.dumps({"choices": [{"index": 0, "text": "tok"}]}) + "\n"
    script = [["send", head]]
    for _ in range(3):
        script += [["send", f"{len(line):x}\r\n{line}\r\n"], ["pause", 0.05]]
    script += [["reset"]]
    status, record, window = scripted(
        tmp_path, "/v1/completions", {"prompt": "x", "raw_script": script}
    )
    assert (status, record["status"], record["ttft_s"]) == (200, "upstream_error", None)
    assert (window["ttft_censored"], window["ttft_p95"]) == (0, None)
