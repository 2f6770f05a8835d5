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

from collections import OrderedDict
from collections.abc import Sequence

from policies.routing import Load, Router, RouteRequest


class SessionTable:
    """session key → backend name, bounded, least recently used evicted."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.max_sessions = max_sessions
        self._backend: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backend)

    def get(self, session: str) -> str | None:
        name = self._backend.get(session)
        if name is not None:
            self._backend.move_to_end(session)
        return name

    def remember(self, session: str, backend: str) -> None:
        self._backend[session] = backend
        self._backend.move_to_end(session)
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
