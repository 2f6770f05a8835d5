"""Timing and token accounting of one streamed response, event by event.

TTFT is the first event that carries output (content, reasoning or a tool-call
delta), not the role-only first chunk and not the first byte. Looking inside
an event stops at a couple of byte searches; JSON is parsed only for the
usage chunk, once per stream.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.window import RollingWindow

# What an event is looked at for; the definitions are the regular expressions,
# the functions below find the same matches with byte searches first (a few
# times cheaper per event than one alternation regex scanning every quote).
# A non-empty string value of an output field, or a tool-call delta.
_OUTPUT = re.compile(
    rb'"(?:content|reasoning_content|reasoning|text)"\s*:\s*"(?!")|"tool_calls"\s*:\s*\[\s*\{'
)
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"')
_USAGE_CHUNK = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_DONE = b"data: [DONE]"

_OUTPUT_KEYS = (b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"')
_STRING_VALUE = re.compile(rb'\s*:\s*"(?!")')  # anchored right after an output key
_TOOL_CALLS = re.compile(rb'"tool_calls"\s*:\s*\[\s*\{')
_FINISH_VALUE = re.compile(rb'\s*:\s*"([A-Za-z_]+)"')  # anchored after "finish_reason"
_EMPTY_ARRAY = re.compile(rb"\s*:\s*\[\s*\]")  # anchored after "choices"


def carries_output(event: bytes) -> bool:
    """``_OUTPUT.search(event)``, by byte search: compact JSON needs no regex at all."""
    for key in _OUTPUT_KEYS:
        at = event.find(key)
        while at >= 0:
            at += len(key)
            if event.startswith(b':"', at):
                if not event.startswith(b'"', at + 2):
                    return True
            elif _STRING_VALUE.match(event, at):
                return True
            at = event.find(key, at - 1)  # a closing quote may open the next key
    return b'"tool_calls"' in event and _TOOL_CALLS.search(event) is not None


def finish_reason_of(event: bytes) -> str | None:
    """The first ``_FINISH`` match's reason, in one pass: ``"finish_reason":null``, in every
    event but the last, is skipped by a comparison."""
    at = event.find(b'"finish_reason"')
    while at >= 0:
        at += 15
        if not event.startswith(b":null", at):
            match = _FINISH_VALUE.match(event, at)
            if match:
                return match.group(1).decode()
        at = event.find(b'"finish_reason"', at - 1)
    return None


def is_usage_chunk(event: bytes) -> bool:
    """A usage key and an empty ``choices`` array (``_USAGE_CHUNK``): the usage-only chunk."""
    if b'"usage"' not in event:
        return False
    at = event.find(b'"choices"')
    while at >= 0:
        at += 9
        if _EMPTY_ARRAY.match(event, at):
            return True
        at = event.find(b'"choices"', at - 1)
    return False


# Batching window updates keeps their cost off the per-chunk path while the
# controller still sees a stream's tokens within a fraction of a second.
FLUSH_INTERVAL_S = 0.25


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        return cls(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


@dataclass(slots=True)
class StreamMeter:
    """Feeds on framed events in arrival order; reads times from ``clock``."""

    started: float  # when the gateway received the request
    strip_usage: bool = False  # the gateway asked for usage; the client did not
    clock: Callable[[], float] = time.perf_counter
    first_output: float | None = None
    last_output: float | None = None
    output_events: int = 0
    gaps: list[float] = field(default_factory=list)
    usage: Usage | None = None
    finish_reason: str | None = None
    upstream_error: bool = False
    done: bool = False
    # Live feed of the backend's rolling window (None: not fed, e.g. in the bench).
    window: RollingWindow | None = None
    admitted: float = 0.0  # when the backend was chosen; its TTFT starts here
    flushed_gaps: int = 0
    flushed_events: int = 0
    last_flush: float = 0.0

    def observe(self, events: list[bytes]) -> list[bytes] | None:
        """Record ``events``; returns the events to forward when one must be dropped."""
        now = self.clock()
        dropped: int | None = None
        for position, event in enumerate(events):
            output = carries_output(event)
            if output:
                if self.first_output is None:
                    self.first_output = self.last_flush = now
                    if self.window is not None:
                        self.window.add_ttft(now, now - self.admitted)
                else:
                    self.gaps.append(now - self.last_output)  # type: ignore[operator]
                self.last_output = now
                self.output_events += 1
            if self.finish_reason is None:
                self.finish_reason = finish_reason_of(event)
            # The usage-only chunk has empty choices: it never carries output.
            if not output and is_usage_chunk(event):
                self._read_usage(event)
                if self.strip_usage:
                    dropped = position
            elif event.startswith(_DONE):
                self.done = True
            elif event.startswith(b'data: {"error"'):
                self.upstream_error = True
        if self.window is not None and now - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush(now)
        if dropped is None:
            return None
        return events[:dropped] + events[dropped + 1 :]

    def flush(self, now: float) -> None:
        """Hand the gaps and output events seen since the last flush to the window."""
        window = self.window
        if window is None:
            return
        window.add_itl(now, self.gaps[self.flushed_gaps :])
        window.add_tokens(now, self.output_events - self.flushed_events)
        self.flushed_gaps = len(self.gaps)
        self.flushed_events = self.output_events
        self.last_flush = now

    def _read_usage(self, event: bytes) -> None:
        payload = event.partition(b"data:")[2]
        try:
            self.usage = Usage.from_json(json.loads(payload).get("usage"))
        except (ValueError, AttributeError):
            self.usage = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    def token_gaps(self) -> list[float]:
        """Inter-token latencies: an event carrying k tokens spreads its gap over k."""
        if not self.gaps:
            return []
        completion = self.usage.completion_tokens if self.usage else 0
        per_event = completion / self.output_events if completion > self.output_events else 1.0
        if per_event == 1.0:
            return self.gaps
        return [gap / per_event for gap in self.gaps for _ in range(round(per_event))]
