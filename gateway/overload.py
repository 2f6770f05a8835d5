"""The gateway's own shortage: a backend it could not reach for want of its own resources.

What counts as one (the ``errno`` of ``socket()``/``connect()``, or of the name lookup
before them), the exception the transport raises for it, the 503 the client gets, and
the warning the operator reads: at most one per interval, so that a burst of ten
thousand such requests is a line and a count, not ten thousand lines. The rejections
metric counts every one of them; the log only has to say what to fix.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from gateway.errors import Unavailable

if TYPE_CHECKING:
    from backends.replica import Replica

log = logging.getLogger("kneecap")

# What the gateway's process or host has run out of, by the errno it fails with, and the
# knob that gives more. A name lookup that cannot open /etc/hosts or a DNS socket fails
# with EAI_SYSTEM, which Python raises as the OSError of its errno: the same list.
_SHORTAGES = {
    errno.EMFILE: "open files: ulimit -n",
    errno.ENFILE: "the system's open files: fs.file-max",
    errno.ENOBUFS: "socket buffers, or memory",
    errno.ENOMEM: "memory",
    # No local port left to the backend's address: connections in TIME_WAIT, or too
    # narrow a range. (Also what ``[::1]`` gives on a host with IPv6 off: a config slip
    # on the gateway's side, answered 503 all the same, the log naming the errno.)
    errno.EADDRNOTAVAIL: "local ports: net.ipv4.ip_local_port_range, or sockets in TIME_WAIT",
}
LOCAL_SHORTAGES = frozenset(_SHORTAGES)


class GatewayOutOfResources(httpx.ConnectError):
    """The gateway could not connect for want of its own resources (file descriptors,
    local ports, socket buffers, memory): no fault of the backend, which any other would
    share.

    An ``httpx.ConnectError`` still, so a caller that knows no better (a metrics scrape)
    takes it as the failed call it is; the proxy and the health probe tell it apart."""


def local_shortage(exc: BaseException) -> OSError | None:
    """The ``OSError`` of a local shortage behind ``exc`` (httpx's own transport chains the
    original under its ``ConnectError``), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in LOCAL_SHORTAGES:
            return seen
        if isinstance(seen, BaseExceptionGroup):
            # Each address of the backend's name tried (anyio's happy eyeballs): the
            # gateway's shortage only if it stopped every attempt; one refused is the
            # backend's answer.
            found = [local_shortage(each) for each in seen.exceptions]
            return found[0] if all(found) else None
        seen = seen.__cause__ or seen.__context__
    return None


def describe(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}"


def shortage_hint(exc: BaseException) -> str:
    """Which of the gateway's limits ``exc`` ran into, for the operator."""
    if isinstance(exc, httpx.PoolTimeout):
        return "upstream.max_connections"
    shortage = local_shortage(exc)
    return _SHORTAGES[shortage.errno] if shortage is not None else "open files, or memory"


class ThrottledWarning:
    """A warning logged at most once per ``every_s``: the first at once, those within the
    interval after it only counted, and the count told with the next one logged.

    No timer: a burst that stops leaves its last count untold, but the rejections metric
    has it. ``clock`` is injectable for tests."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._quiet_until = float("-inf")
        self._logged_at = 0.0
        self.suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._quiet_until:
            self.suppressed += 1
            return
        if self.suppressed:
            message += " (and %d more like it in the %.0f s before, not logged)"
            args = (*args, self.suppressed, now - self._logged_at)
            self.suppressed = 0
        self._logged_at = now
        self._quiet_until = now + self._every_s
        self._logger.warning(message, *args)


class _Hint:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __str__(self) -> str:
        return shortage_hint(self.exc)


def overload_warning() -> ThrottledWarning:
    return ThrottledWarning(log)


def gateway_overloaded(
    warning: ThrottledWarning,
    replica: Replica,
    request_id: str,
    exc: GatewayOutOfResources | httpx.PoolTimeout,
) -> Unavailable:
    """The 503 for a call the gateway could not make for want of its own resources, logged
    as what it is: the operator's fix is the gateway's limits, not the backend."""
    warning.warning(
        "request %s: could not connect to backend %s: %s; the gateway's own limit (%s), "
        "not the backend's fault",
        request_id,
        replica.name,
        exc,
        _Hint(exc),  # read only when the line is logged, not for each one a burst holds back
    )
    return Unavailable(
        f"the gateway is out of resources to reach a backend ({exc}); retry shortly",
        code="gateway_overloaded",
        headers={"retry-after": "1"},
    )
