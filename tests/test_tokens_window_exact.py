"""A backend's window counts a finished stream's output tokens exactly: the live
estimates (output events times the backend's learned tokens per event) are replaced
by the usage's counts at the end, down as well as up, in the entries they went to.

The window's tokens/s is what the knee controller reads, what ``/admin/state`` shows
and the ``kneecap_output_tokens_per_second`` gauge."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.meter import FLUSH_INTERVAL_S, StreamMeter, Usage
from gateway.window import RollingWindow
from tests.procs import (
    Gateway,
    Proc,
    scripted_config,
    served,
    served_gateway,
    start_raw_sse,
)
from tests.test_relay_edge_cases import (
    CHAT,
    DONE,
    LAST_CHUNK,
    SSE_HEAD,
    body,
    chunks,
    delta,
    usage,
)


def _event(finish: str | None = None) -> bytes:
    payload = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    payload["choices"][0]["finish_reason"] = finish
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode()


def _stream(window: RollingWindow, events: int, step: float, start: float = 100.0) -> StreamMeter:
    """A stream of ``events`` output events, one every ``step`` seconds, flushed live."""
    clock = [start]
    meter = StreamMeter(started=start, clock=lambda: clock[0], window=window, admitted=start)
    for i in range(events):
        clock[0] += step
        meter.observe([_event("length" if i == events - 1 else None)])
    return meter


def test_a_stream_with_fewer_tokens_an_event_than_learned_is_counted_down() -> None:
    window = RollingWindow(span_s=1000, created=0.0)
    window.learn_tokens_per_event(4.0)  # the backend's earlier streams: 4 tokens an event
    meter = _stream(window, 20, 0.05)
    meter.usage = Usage(5, 20)  # this one: a token an event
    end = 100.0 + 20 * 0.05
    meter.flush(end, final=True)
    assert window.output_tokens_per_s(end) * end == pytest.approx(20)


def test_a_stream_with_more_tokens_an_event_than_learned_is_counted_up() -> None:
    window = RollingWindow(span_s=1000, created=0.0)
    meter = _stream(window, 20, 0.05)  # learned: one an event
    meter.usage = Usage(5, 77)  # the first token alone, then 4 an event
    end = 100.0 + 20 * 0.05
    meter.flush(end, final=True)
    assert window.output_tokens_per_s(end) * end == pytest.approx(77)


def test_the_correction_stays_where_the_estimates_went() -> None:
    """Each flush's tokens are set where they were counted: once the stream's first
    second has left the window, what remains is the exact count of its later events,
    not a correction made at its end outliving the estimates it corrected."""
    window = RollingWindow(span_s=1.0, created=0.0)
    window.learn_tokens_per_event(4.0)
    step = FLUSH_INTERVAL_S / 5
    meter = _stream(window, 100, step)  # 2 s of events, flushed every FLUSH_INTERVAL_S
    meter.usage = Usage(5, 100)
    end = 100.0 + 100 * step
    meter.flush(end, final=True)
    # In the last second: the events after end - 1 s, a token each (the last flush's
    # entry, at ``end``, included; entries are stamped with their flush's time).
    flushes = [entry for entry in window._tokens if entry[0] >= end - 1.0]
    counted = sum(count for _, count in flushes)
    assert window.output_tokens_per_s(end) == pytest.approx(counted)
    assert counted <= 1.0 / step + FLUSH_INTERVAL_S / step  # a token an event, at most
    assert counted >= 1.0 / step - FLUSH_INTERVAL_S / step


def test_a_usage_below_the_events_read_takes_the_latest_entries_down() -> None:
    window = RollingWindow(span_s=1000, created=0.0)
    meter = _stream(window, 20, 0.05)
    meter.usage = Usage(5, 12)  # fewer than the events: taken at its word
    end = 100.0 + 20 * 0.05
    meter.flush(end, final=True)
    assert window.output_tokens_per_s(end) * end == pytest.approx(12)
    assert all(count >= 0 for _, count in window._tokens)


# --- through the gateway --------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokens")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc) -> Iterator[Gateway]:
    # Longer than the test: nothing leaves the window, whose age divides its tokens.
    config = scripted_config(raw, measurement={"window_s": 600})
    yield from served_gateway(module_tmp, config)


def _paced(events: int, tokens: int, pause: float) -> list:
    script: list = [["send", SSE_HEAD]]
    for i in range(events):
        script += [["pause", pause], *chunks(delta("x", "length" if i == events - 1 else None))]
    return [*script, *chunks(usage(5, tokens), DONE), ["send", LAST_CHUNK]]


def _tokens_per_s(gw: Gateway) -> tuple[float, float]:
    """The backend's window's output tokens/s, and when it was read (client's clock)."""
    state = httpx.get(gw.url + "/admin/state", timeout=5).json()
    return state["backends"][0]["window"]["output_tokens_per_s"], time.perf_counter()


def test_window_tokens_of_a_stream_are_its_usage_through_the_gateway(gw: Gateway) -> None:
    """Stream A (5 events, 20 tokens) teaches the backend 4.75 tokens an event; stream B
    (40 events over ~1.2 s, a token each) is counted live at that ratio. Once B ended,
    the window holds 20 + 40 tokens, not B's estimate. The window's age (its tokens/s
    divides by it) is read off A's figure: 20 tokens / (A's tokens/s)."""
    a = httpx.post(gw.url + CHAT, json=body(_paced(5, 20, 0.0)), timeout=10)
    assert a.status_code == 200
    rate_a, read_a = _tokens_per_s(gw)
    b = httpx.post(gw.url + CHAT, json=body(_paced(40, 40, 0.03)), timeout=10)
    assert b.status_code == 200
    rate_b, read_b = _tokens_per_s(gw)
    age_b = 20 / rate_a + (read_b - read_a)
    assert rate_b * age_b == pytest.approx(60, rel=0.05)
