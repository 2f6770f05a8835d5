"""Every local port to an address used up: the port range narrowed to two ports, then
connections held until the kernel has none left (EADDRNOTAVAIL). Only in a network
namespace of one's own, whose port range is its own."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
NARROW = "40000 40001"


def use_up(
    address: tuple[str, int], held: list[socket.socket], family: int = socket.AF_INET
) -> None:
    """Connect to ``address`` until no local port to it is left; the sockets go to ``held``."""
    while True:
        sock = socket.socket(family)
        try:
            sock.connect(address)
        except OSError as exc:
            sock.close()
            assert exc.errno == 99, exc  # EADDRNOTAVAIL: the range is used up
            return
        held.append(sock)


@contextmanager
def no_local_port_to(address: tuple[str, int]) -> Iterator[int]:
    """No local port to ``address`` while inside (a port to any other address is still
    free); yields how many connections hold them. The range and the ports come back after."""
    wide = RANGE.read_text()
    held: list[socket.socket] = []
    RANGE.write_text(NARROW)
    try:
        use_up(address, held)
        assert held  # used up by the holders, not before them
        yield len(held)
    finally:
        for sock in held:
            sock.close()
        RANGE.write_text(wide)


def in_own_network_namespace(script: str, *args: str) -> list[str]:
    """The command that runs Python ``script`` (with ``args``) in a network namespace of
    its own, its loopback up."""
    command = 'ip link set lo up && exec "$0" -c "$@"'
    return ["unshare", "-n", "sh", "-c", command, sys.executable, script, *args]
