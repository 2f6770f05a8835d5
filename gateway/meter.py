"""Timing and token accounting of one streamed response, event by event.

TTFT is the first event that carries output (content, reasoning or a tool-call
delta), not the role-only first chunk and not the first byte. Looking inside
an event stops at a couple of byte searches; JSON is parsed only for usage:
the usage chunk's, and the finishing chunk's when it carries some.
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
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')  # not ``"usage":null``
# An engine's error event, in any legal spelling: an ``error`` event type, or data
# whose JSON object opens with an ``"error"`` key.
_ERROR_EVENT = re.compile(
    rb'(?:^|[\r\n])(?:event:[ ]?error[ \t]*(?:[\r\n]|$)|data:[ \t]*\{\s*"error"\s*:)'
)
_DONE = b"data: [DONE]"
# How engines spell the first choice of a chunk (compact JSON, ``index`` first). In a
# stream of several sequences (n > 1, a batch of prompts), whose chunks interleave, an
# event spelled otherwise is read as JSON for its choice's index.
_FIRST_SEQUENCE = b'"choices":[{"index":0,'

_OUTPUT_KEYS = (b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"')
_STRING_VALUE = re.compile(rb'\s*:\s*"(?!")')  # anchored right after an output key
_TOOL_CALLS = re.compile(rb'"tool_calls"\s*:\s*\[\s*\{')
_FINISH_VALUE = re.compile(rb'\s*:\s*"([A-Za-z_]+)"')  # anchored after "finish_reason"
_EMPTY_ARRAY = re.compile(rb"\s*:\s*\[\s*\]")  # anchored after "choices"
_OBJECT_VALUE = re.compile(rb"\s*:\s*\{")  # anchored after "usage"


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
    """Usage as an object (``_USAGE_OBJECT``) and an empty ``choices`` array
    (``_USAGE_CHUNK``): the usage-only chunk. Empty choices with ``"usage":null`` are
    some other event (a prompt filter's results), the client's to have."""
    at = event.find(b'"usage"')
    while at >= 0:
        at += 7
        if event.startswith(b":{", at) or _OBJECT_VALUE.match(event, at):
            break
        at = event.find(b'"usage"', at - 1)
    else:
        return False
    at = event.find(b'"choices"')
    while at >= 0:
        at += 9
        if _EMPTY_ARRAY.match(event, at):
            return True
        at = event.find(b'"choices"', at - 1)
    return False


def is_error_event(event: bytes) -> bool:
    """``_ERROR_EVENT.search(event)``; the usual spelling costs one comparison, an event
    without the word none but a byte search."""
    if event.startswith(b'data: {"error"'):
        return True
    return b"error" in event and _ERROR_EVENT.search(event) is not None


_CLIENT_ERROR_TYPES = frozenset({"BadRequestError", "invalid_request_error", "NotFoundError"})


def blames_the_request(event: bytes) -> bool:
    """An error event whose code is a 4xx (vLLM reports a request it finds bad after the
    stream started this way): the request's fault, not the backend's. Read only for error
    events, which end a stream."""
    try:
        error = json.loads(_data_of(event)).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        return 400 <= code < 500
    return error.get("type") in _CLIENT_ERROR_TYPES


# Batching window updates keeps their cost off the per-chunk path while the
# controller still sees a stream's tokens within a fraction of a second.
FLUSH_INTERVAL_S = 0.25


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        """The backend's ``usage`` object; None for anything else (untrusted input: a count
        that is no whole number must not cost the client its answer)."""
        if not isinstance(usage, dict):
            return None
        prompt = usage.get("prompt_tokens") or 0
        completion = usage.get("completion_tokens") or 0
        if type(prompt) is not int or type(completion) is not int:
            return None
        return cls(prompt, completion)


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
    client_error: bool = False  # the engine's error event blames the request (a 4xx code)
    done: bool = False
    # The request may stream several sequences (n > 1, a list of prompts): each output
    # event's gap then runs from its own sequence's last output time.
    several_sequences: bool = False
    last_by_sequence: dict[int | None, float] | None = None
    # Live feed of the backend's rolling window (None: not fed, e.g. in the bench).
    window: RollingWindow | None = None
    admitted: float = 0.0  # when the backend was chosen; its TTFT starts here
    flushed_gaps: int = 0
    flushed_events: int = 0
    last_flush: float = 0.0

    def observe(self, events: list[bytes]) -> list[bytes] | None:
        """Record ``events``; returns the events to forward when some must be dropped."""
        now = self.clock()
        dropped: list[int] | None = None
        for position, event in enumerate(events):
            if self.finish_reason is None:
                reason = finish_reason_of(event)
                # The first sequence's, as a whole answer's is read (its first choice).
                if reason is not None and (not self.several_sequences or _of_first_sequence(event)):
                    self.finish_reason = reason
                    if b'"usage"' in event:
                        # Usage riding on the last chunk with choices, not on one of its
                        # own (continuous usage stats put it on every chunk): read once.
                        self._read_usage(event)
            if carries_output(event):
                if self.first_output is None:
                    self.first_output = self.last_flush = now
                    if self.window is not None:
                        self.window.add_ttft(now, now - self.admitted)
                    if self.several_sequences:
                        self._sequence_output(event, now)
                elif not self.several_sequences:
                    self.gaps.append(now - self.last_output)  # type: ignore[operator]
                else:
                    self._sequence_output(event, now)
                self.last_output = now
                self.output_events += 1
            # The usage-only chunk has empty choices: it never carries output.
            elif is_usage_chunk(event):
                self._read_usage(event)
                if self.strip_usage:
                    dropped = [position] if dropped is None else [*dropped, position]
            elif event.startswith(_DONE):
                self.done = True
            elif is_error_event(event):
                if blames_the_request(event):
                    self.client_error = True
                else:
                    self.upstream_error = True
        if self.window is not None and now - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush(now)
        if dropped is None:
            return None
        return [event for position, event in enumerate(events) if position not in dropped]

    def _sequence_output(self, event: bytes, now: float) -> None:
        """An output event of a stream that may hold several sequences: its gap runs from
        the same sequence's previous output event, not from another sequence's."""
        seen = self.last_by_sequence
        if seen is None:
            seen = self.last_by_sequence = {}
        index = 0 if _FIRST_SEQUENCE in event else _choice_index(event)
        last = seen.get(index)
        if last is not None:
            self.gaps.append(now - last)
        seen[index] = now

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
        """Keeps the usage read before when this one cannot be read."""
        try:
            usage = Usage.from_json(json.loads(_data_of(event)).get("usage"))
        except (ValueError, AttributeError):
            usage = None
        if usage is not None:
            self.usage = usage

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    def token_gaps(self) -> list[float]:
        """Inter-token latencies: the gap before an event carrying k tokens, as k values of
        gap/k, so they add up to the time from the first output event to the last (of
        each sequence, when the stream holds several).

        Events are taken to carry the usage's tokens evenly; k is a whole number per
        event, spread so that the gaps hold ``floor(gaps * tokens per event)`` values.
        Rounding down: a token counted by usage but carried by no output event (the EOS
        of an empty final chunk) makes no gap of its own."""
        gaps = self.gaps
        completion = self.usage.completion_tokens if self.usage else 0
        if not gaps or completion <= self.output_events:
            return gaps
        count = len(gaps)
        values = count * completion // self.output_events
        spread = []
        for index, gap in enumerate(gaps):
            tokens = (index + 1) * values // count - index * values // count
            spread += [gap / tokens] * tokens
        return spread


def _choice_index(event: bytes) -> int | None:
    """The index of the event's (first) choice; None when it has none to read."""
    try:
        choices = json.loads(_data_of(event)).get("choices")
        index = choices[0].get("index")
    except (ValueError, AttributeError, IndexError, KeyError, TypeError):
        return None
    return index if type(index) is int else None


def _of_first_sequence(event: bytes) -> bool:
    return _FIRST_SEQUENCE in event or _choice_index(event) in (0, None)


def _data_of(event: bytes) -> bytes:
    """The event's data: its ``data:`` lines' values, joined by newlines."""
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
