"""Incremental Server-Sent-Events framing over raw upstream chunks.

The relay forwards bytes as they arrive; this only finds event boundaries so
that events can be timed, the gateway's own usage chunk dropped, and only
whole events written (an error event then never lands inside a half-sent one).
What goes to the client is always the backend's own bytes: :meth:`SSEFramer.join`
rebuilds them exactly from the events it returned.

SSE ends lines with ``\\n``, ``\\r\\n`` or ``\\r``; an event ends at a blank line.
Engines send ``\\n\\n``, which is split by one byte search; anything holding a
``\\r`` goes through a regular expression instead, on raw bytes, never normalised.

An event too long to hold is *released*: its bytes go out as they come, and framing
resumes at its blank line. Its first and last bytes are kept so that it can still be
read as an event (:meth:`SSEFramer.released_event`).
"""

from __future__ import annotations

import re

_SEP = b"\n\n"
# Two line ends in a row. ``\r(?!\n)``: the ``\r`` of a ``\r\n`` is not a line end
# of its own, so ``\r\n`` between two fields never reads as a blank line.
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
# The longest blank line (``\r\n\r\n``) but its last byte: how much of one a read may end in.
_BLANK_LINE_BEGUN = 3
# What is kept of a released event at each end: where engines put what an event is read
# for (its output, before logprobs or an echoed prompt; its finish reason and usage, after).
RELEASED_KEPT_BYTES = 64 * 1024


def _may_end_event(pending: bytes | bytearray, chunk: bytes) -> bool:
    """Whether ``chunk`` may end the pending event. ``pending`` holds no blank line, so
    one can only be in ``chunk`` or straddle the two; True may be a false alarm (a
    ``\\r\\n\\r`` that a read cut), which the full search then tells apart."""
    tail = pending[-_BLANK_LINE_BEGUN:]
    if b"\r" in tail or b"\r" in chunk:
        return _BLANK_LINE.search(tail + chunk) is not None
    # Engines' events: byte searches of the read itself, no copy of it.
    return _SEP in chunk or (tail.endswith(b"\n") and chunk.startswith(b"\n"))


class SSEFramer:
    __slots__ = ("_after_cr", "_released_head", "_released_tail", "_separator", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._separator = _SEP  # what :meth:`join` puts back between the last events
        # The last boundary was a ``\r`` at the end of a read: a ``\n`` opening the next
        # read completes that line end, so it is handed on alone, not as the first
        # byte of the next event (which would then not start with its field name).
        self._after_cr = False
        # Of the event released last: its first bytes, and its last ones so far.
        self._released_head = b""
        self._released_tail = b""

    def feed(self, chunk: bytes) -> tuple[bytes, list[bytes]]:
        """The whole events completed by ``chunk``: their raw bytes, and each event.

        The bytes are ``chunk`` itself, no copy, when no event was pending before it
        and it ends at a boundary (the common case). An unterminated end stays pending.
        """
        tail = self._tail
        if tail:
            if not _may_end_event(tail, chunk):
                # A long event arriving in many reads: grown in place, and only its new
                # bytes searched, or each read would copy and scan all of it again.
                if type(tail) is bytes:
                    self._tail = tail = bytearray(tail)
                tail += chunk
                return b"", []
            data = b"".join((tail, chunk))
        else:
            data = chunk
        if b"\r" in data or self._after_cr:
            return self._feed_any_line_end(data)
        self._separator = _SEP
        events = data.split(_SEP)
        self._tail = tail = events.pop()
        return (data[: len(data) - len(tail)] if tail else data), events

    def _feed_any_line_end(self, data: bytes) -> tuple[bytes, list[bytes]]:
        # Events keep their own line ends here, so they join back with nothing between.
        self._separator = b""
        after_cr, self._after_cr = self._after_cr, False
        events = []
        start = 0
        if after_cr and data.startswith(b"\n"):
            events.append(b"\n")
            start = 1
        for blank in _BLANK_LINE.finditer(data, start):
            end = blank.end()
            if end == len(data) and blank.group() == b"\r\n\r":
                break  # a CRLF blank line cut in two, most likely: its \n comes next
            events.append(data[start:end])
            start = end
        if not events:
            self._tail = data
            return b"", events
        self._tail = data[start:]
        self._after_cr = not self._tail and data.endswith(b"\r")
        return data[:start], events

    def join(self, events: list[bytes]) -> bytes:
        """The raw bytes of ``events``, some of the last :meth:`feed`'s."""
        separator = self._separator
        if not separator:
            return b"".join(events)
        return b"".join(event + separator for event in events)

    @property
    def pending(self) -> bytes:
        """Bytes of an event that has not been terminated yet."""
        return bytes(self._tail)

    @property
    def pending_size(self) -> int:
        return len(self._tail)

    def release_pending(self) -> bytes:
        """The pending bytes, no longer held: the start of an event too long to hold, to go
        out now. The rest of it goes out as it comes, until :meth:`end_of_released`."""
        tail, self._tail = bytes(self._tail), b""
        self._released_head = tail[:RELEASED_KEPT_BYTES]
        self._released_tail = tail[-RELEASED_KEPT_BYTES:]
        return tail

    def end_of_released(self, chunk: bytes) -> int:
        """Where in ``chunk`` the released event ends, just past its blank line: framing
        resumes there. -1 while it goes on.

        The event's last bytes before ``chunk`` are searched with it, for a blank line a
        read cut in two; the blank line is found as :meth:`feed` finds it.
        """
        kept = self._released_tail
        begun = kept[-_BLANK_LINE_BEGUN:]
        data = begun + chunk
        end = -1
        if b"\r" in data:
            blank = _BLANK_LINE.search(data)
            # ``\r\n\r`` ending the read: most likely a CRLF blank line whose ``\n`` comes next.
            if blank and not (blank.end() == len(data) and blank.group() == b"\r\n\r"):
                end = blank.end()
        else:
            end = data.find(_SEP)
            if end >= 0:
                end += len(_SEP)
        if end < 0:
            self._released_tail = (kept + chunk)[-RELEASED_KEPT_BYTES:]
            return -1
        self._after_cr = end == len(data) and data.endswith(b"\r")
        end -= len(begun)
        self._released_tail = (kept + chunk[:end])[-RELEASED_KEPT_BYTES:]
        return end

    def released_event(self) -> bytes:
        """The released event, as far as the meter reads it: its first and last bytes (a
        line end between them, so that no field name forms across the gap). Not JSON: a
        usage it carried is not read."""
        return self._released_head + b"\n" + self._released_tail
