"""When a request reached the simulated backend: the moment its first byte was parsed.

A real engine's clock keeps running while its HTTP layer reads, parses and
tokenizes a request; the simulator's HTTP layer costs wall time too, but at
``--speed K`` every microsecond of it would count K times over in engine time
(half a millisecond of handler work is 10 ms of TTFT at ``--speed 20``, a GPU
cost no model on the virtual clock pays). So the engine takes the request as
arriving when its bytes did, not when the handler got round to it. The stamp
is taken in the HTTP parser's message-begin callback, which runs inside the
socket's read callback, and travels in the ASGI scope's ``extensions``.

Pass :data:`HTTP_PROTOCOL` as uvicorn's ``http``; without httptools it is
uvicorn's default, the scope carries no stamp and requests arrive when handled.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Scope

ARRIVAL = "kneecap.arrival"


def arrival_of(scope: Scope) -> float | None:
    """The request's arrival on ``time.monotonic`` (the real-clock engine's clock), or None
    when the server did not stamp it."""
    stamp = (scope.get("extensions") or {}).get(ARRIVAL)
    return None if stamp is None else stamp["time"]


def stamp(scope: dict[str, Any], now: float) -> None:
    scope.setdefault("extensions", {})[ARRIVAL] = {"time": now}


HTTP_PROTOCOL: Any  # what uvicorn.Config takes as ``http``: a protocol class or a name
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn serves with h11, unstamped
    HTTP_PROTOCOL = "auto"
else:

    class ArrivalStampingProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol, stamping each request as its first byte is parsed."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            stamp(self.scope, time.monotonic())  # type: ignore[arg-type]

    HTTP_PROTOCOL = ArrivalStampingProtocol
