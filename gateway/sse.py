"""Incremental Server-Sent-Events framing over raw upstream chunks.

The relay forwards bytes as they arrive; this only finds event boundaries so
that events can be timed, the gateway's own usage chunk dropped, and only
whole events written (an error event then never lands inside a half-sent one).
What goes to the client is always the backend's own bytes: :meth:`SSEFramer.join`
rebuilds them exactly from the events it returned.

SSE ends lines with ``\\n``, ``\\r\\n`` or ``\\r``; an event ends at a blank line.
Engines send ``\\n\\n``, which is split by one byte search; anything holding a
``\\r`` goes through a regular expression instead, on raw bytes, never normalised.
"""

from __future__ import annotations

import re

_SEP = b"\n\n"
# Two line ends in a row. ``\r(?!\n)``: the ``\r`` of a ``\r\n`` is not a line end
# of its own, so ``\r\n`` between two fields never reads as a blank line.
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")


class SSEFramer:
    __slots__ = ("_after_cr", "_separator", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._separator = _SEP  # what :meth:`join` puts back between the last events
        # The last boundary was a ``\r`` at the end of a read: a ``\n`` opening the next
        # read completes that line end, so it is handed on alone, not as the first
        # byte of the next event (which would then not start with its field name).
        self._after_cr = False

    def feed(self, chunk: bytes) -> tuple[bytes, list[bytes]]:
        """The whole events completed by ``chunk``: their raw bytes, and each event.

        The bytes are ``chunk`` itself, no copy, when no event was pending before it
        and it ends at a boundary (the common case). An unterminated end stays pending.
        """
        data = self._tail + chunk if self._tail else chunk
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
        return self._tail

    def take_pending(self) -> bytes:
        """The pending bytes, no longer held: framing starts afresh after them."""
        tail, self._tail, self._after_cr = self._tail, b"", False
        return tail
