"""uvicorn's httptools protocol, stamping when a request's first bytes were read."""

from __future__ import annotations

import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ARRIVED_SCOPE_KEY = "kneecap.arrived"


class GatewayProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ARRIVED_SCOPE_KEY] = time.perf_counter()  # type: ignore[typeddict-unknown-key]
