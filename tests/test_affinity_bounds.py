"""The session table is bounded in memory, not only in count: keys come from clients."""

from __future__ import annotations

import sys

from policies.affinity import SessionTable


def _held_bytes(table: SessionTable) -> int:
    entries = table._backend  # what the table keeps is the point here
    return sys.getsizeof(entries) + sum(sys.getsizeof(k) for k in entries)


def test_long_session_keys_are_not_kept_whole() -> None:
    table = SessionTable(max_sessions=1000)
    for i in range(300):
        table.remember(f"{i}:" + "x" * 256_000, "a")
    assert len(table) == 300
    # Whole keys were 300 x 256 KB = 77 MB; digests are a few dozen bytes each.
    assert _held_bytes(table) < 100_000, _held_bytes(table)
    assert table.get("7:" + "x" * 256_000) == "a"
    assert table.get("7:" + "x" * 255_999) is None


def test_a_lower_bound_trims_at_once_least_recent_first() -> None:
    table = SessionTable(max_sessions=10)
    for i in range(10):
        table.remember(f"s{i}", f"b{i}")
    table.get("s0")  # now the most recent
    table.resize(3)
    assert len(table) == 3
    assert [table.get(s) for s in ("s0", "s8", "s9", "s1")] == ["b0", "b8", "b9", None]
