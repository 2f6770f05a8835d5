"""Session affinity: a conversation returns to the backend holding its prefix cache.

:class:`Sticky` wraps any router. A request with a session key goes to the
backend that served the session last, if that backend is among the candidates,
fits the request, and is less than ``max_load`` full before it (the fullest of
requests, tokens and KV, see :meth:`Load.pressure`). Otherwise (saturated,
gone, or in another pool) the wrapped router chooses, and the session moves to
its choice. Sessions are forgotten least recently used first beyond
``max_sessions``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from policies.routing import Load, Router, RouteRequest


def _digest(session: str) -> bytes:
    # Keys come from clients (a header, the `user` field) and may be as long as a body:
    # kept whole, 300 keys of 256 KB held 76 MB for good. A digest is 16 bytes whatever
    # the key; two sessions sharing one only share a routing preference.
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionTable:
    """session key → backend name, bounded in count and size, least recently used evicted."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._backend: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backend)

    def get(self, session: str) -> str | None:
        key = _digest(session)
        name = self._backend.get(key)
        if name is not None:
            self._backend.move_to_end(key)
        return name

    def remember(self, session: str, backend: str) -> None:
        key = _digest(session)
        self._backend[key] = backend
        self._backend.move_to_end(key)
        self._trim()

    def resize(self, max_sessions: int) -> None:
        """A lower bound applies now, not at the next new session."""
        self.max_sessions = max_sessions
        self._trim()

    def _trim(self) -> None:
        while len(self._backend) > self.max_sessions:
            self._backend.popitem(last=False)


class Sticky:
    def __init__(self, inner: Router, table: SessionTable, max_load: float = 0.9) -> None:
        self.inner = inner
        self.table = table
        self.max_load = max_load

    def choose(self, loads: Sequence[Load], request: RouteRequest) -> Load | None:
        session = request.session
        if session is None:
            return self.inner.choose(loads, request)
        name = self.table.get(session)
        if name is not None:
            for load in loads:
                if (
                    load.name == name
                    and load.fits(request.cost)
                    and load.pressure(0, requests=0) < self.max_load
                ):
                    return load
        chosen = self.inner.choose(loads, request)
        if chosen is not None:
            self.table.remember(session, chosen.name)
        return chosen
