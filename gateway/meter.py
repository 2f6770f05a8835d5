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

# A non-empty string value of an output field, or a tool-call delta.
_OUTPUT = re.compile(rb'"(?:content|reasoning_content|reasoning|text)":"(?!")|"tool_calls":\[\{')
_FINISH = re.compile(rb'"finish_reason":"([A-Za-z_]+)"')
_DONE = b"data: [DONE]"


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

    def observe(self, events: list[bytes]) -> list[bytes] | None:
        """Record ``events``; returns the events to forward when one must be dropped."""
        now = self.clock()
        dropped: int | None = None
        for position, event in enumerate(events):
            if _OUTPUT.search(event):
                if self.first_output is None:
                    self.first_output = now
                else:
                    self.gaps.append(now - self.last_output)  # type: ignore[operator]
                self.last_output = now
                self.output_events += 1
            if self.finish_reason is None and b'"finish_reason":"' in event:
                match = _FINISH.search(event)
                if match:
                    self.finish_reason = match.group(1).decode()
            if b'"usage":{' in event and b'"choices":[]' in event:
                self._read_usage(event)
                if self.strip_usage:
                    dropped = position
            elif event.startswith(_DONE):
                self.done = True
            elif event.startswith(b'data: {"error"'):
                self.upstream_error = True
        if dropped is None:
            return None
        return events[:dropped] + events[dropped + 1 :]

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
