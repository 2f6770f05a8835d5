"""Within a pool: the healthy replica with the fewest requests in flight."""

from __future__ import annotations

from collections.abc import Iterable

from backends.replica import Replica


def pick_least_loaded(
    replicas: Iterable[Replica], exclude: frozenset[str] = frozenset()
) -> Replica | None:
    best: Replica | None = None
    for replica in replicas:
        if replica.name in exclude or not replica.has_room:
            continue
        if best is None or replica.in_flight / replica.limit < best.in_flight / best.limit:
            best = replica
    return best
