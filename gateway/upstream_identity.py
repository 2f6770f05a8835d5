"""Who a call to a backend is for: the same identity on every call made for one client
request (the proxied one, ``/tokenize``, the estimator's count on a backend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from backends.replica import Replica

Identity = Callable[[Replica], list[tuple[bytes, bytes]]]


def upstream_identity(
    raw_headers: Sequence[tuple[bytes, bytes]],
    request_id: str,
    replica: Replica,
    forward_key: bool,
) -> list[tuple[bytes, bytes]]:
    """Who a call to a backend is for: the request id, and the backend's key, or else the
    client's own when the operator forwards it. Every call made for a client request
    carries them: the proxied one, /tokenize, and the estimator's count on a backend."""
    fields = [(b"x-request-id", request_id.encode("latin-1"))]
    key = replica.config.resolved_api_key()
    if key:
        fields.append((b"authorization", b"Bearer %s" % key.encode("latin-1")))
    elif forward_key:
        fields += [(n, v) for n, v in raw_headers if n == b"authorization"]
    return fields
