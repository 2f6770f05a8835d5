"""Incremental Server-Sent-Events framing over raw upstream chunks.

The relay forwards bytes as they arrive; this only finds event boundaries so
that events can be timed (and the gateway's own usage chunk dropped). Event
bytes are returned without their terminating blank line; :func:`join_events`
puts it back, so the forwarded bytes equal the received ones.
"""

from __future__ import annotations

_SEP = b"\n\n"


class SSEFramer:
    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._tail + chunk if self._tail else chunk
        if b"\r" in data:
            # CRLF framing is legal SSE; normalise only our view of it so the
            # boundaries are found, while forwarding stays byte-exact upstream-side.
            data = data.replace(b"\r\n", b"\n")
        events = data.split(_SEP)
        self._tail = events.pop()
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an event that has not been terminated yet."""
        return self._tail


def join_events(events: list[bytes]) -> bytes:
    return b"".join(event + _SEP for event in events)
