"""What one SSE event of an OpenAI-style stream says, read with byte searches.

Each classifier has a regular expression for its definition and finds the same
matches with byte searches first (a few times cheaper per event than one
alternation regex scanning every quote); JSON is parsed only where a value must
be read (an error's code, a choice's index when it is not spelled compactly).
:mod:`gateway.meter` times streams with them.
"""

from __future__ import annotations

import json
import re

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
DONE = b"data: [DONE]"
# How engines spell the first choice of a chunk (compact JSON, ``index`` first). In a
# stream of several sequences (n > 1, a batch of prompts), whose chunks interleave, an
# event spelled otherwise is read as JSON for its choice's index.
FIRST_SEQUENCE = b'"choices":[{"index":0,'

_OUTPUT_KEYS = (b'"content"', b'"reasoning_content"', b'"reasoning"', b'"text"')
_STRING_VALUE = re.compile(rb'\s*:\s*"(?!")')  # anchored right after an output key
_TOOL_CALLS = re.compile(rb'"tool_calls"\s*:\s*\[\s*\{')
_FINISH_VALUE = re.compile(rb'\s*:\s*"([A-Za-z_]+)"')  # anchored after "finish_reason"
_EMPTY_ARRAY = re.compile(rb"\s*:\s*\[\s*\]")  # anchored after "choices"
_OBJECT_VALUE = re.compile(rb"\s*:\s*\{")  # anchored after "usage"
# Reasoning text: a non-empty string under a reasoning key (not one quoted in a string).
_REASONING = re.compile(rb'(?<!\\)"(?:reasoning_content|reasoning)"\s*:\s*"(?!")')


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
        error = json.loads(data_of(event)).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    # ASCII and short: isdigit() alone takes "²" (int() refuses it) and fullwidth digits
    # (read as 12), and int() refuses 5,000 digits; such a code is judged by its type.
    if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) <= 9:
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        return 400 <= code < 500
    return error.get("type") in _CLIENT_ERROR_TYPES


def carries_reasoning(event: bytes) -> bool:
    """Whether the event carries reasoning text (looked at for a stream's first events)."""
    return b'"reasoning' in event and _REASONING.search(event) is not None


def choice_index(event: bytes) -> int | None:
    """The index of the event's (first) choice; None when it has none to read."""
    try:
        choices = json.loads(data_of(event)).get("choices")
        index = choices[0].get("index")
    except (ValueError, AttributeError, IndexError, KeyError, TypeError):
        return None
    return index if type(index) is int else None


def of_first_sequence(event: bytes) -> bool:
    return FIRST_SEQUENCE in event or choice_index(event) in (0, None)


def data_of(event: bytes) -> bytes:
    """The event's data: its ``data:`` lines' values, joined by newlines."""
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
