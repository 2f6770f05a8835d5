"""Requests queued in a pool that loses its backends, or that a reload removes.

A waiter whose home pool has no replica left that could serve it is planned again, as a
request arriving at that moment would be: served on the pool that plan makes its home,
or refused at once (503 ``no_healthy_backend``) when nothing serves it; never left to sleep until
its queue deadline. A removed pool's series stay until an exposition has shown every
rejection counted on them.

Backends are :mod:`tests.raw_sse_backend` processes: a held stream keeps a replica at its
limit until the test pokes it, so who waits where is set up, not timed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.record import REJECT_REASONS
from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    free_port,
    served,
    start_gateway,
    start_raw_sse,
    wait_until,
)
from tests.test_reload_live import (  # the same raw-backend scripts and config pieces
    NO_BUDGET,
    QUICK_STOP,
    QUIET_HEALTH,
    held_chat,
    reload,
    sse,
    static,
)

# Waiters would sleep this long: every wait below is bounded well under it.
QUEUE_WAIT_S = 20
PROMPT = [{"role": "user", "content": "x"}]  # a short prompt: its home is `short`
POOLS = {
    "short": {"max_prompt_tokens": 8192, "max_queue_wait_s": QUEUE_WAIT_S},
    "long": {"min_prompt_tokens": 8192, "max_queue_wait_s": QUEUE_WAIT_S},
}
SOON_S = 5.0  # a waiter planned again is answered within this (its deadline: 20 s)


@pytest.fixture
def raw(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path))


CLOSING = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def quick_chat() -> dict[str, Any]:
    """Answered whole at once, wherever it goes."""
    script = [["send", CLOSING + sse("a") + "data: [DONE]\n\n"], ["close"]]
    return {"model": MODEL, "stream": True, "messages": PROMPT, "raw_script": script}


class Clients:
    """Streamed chats sent from threads; each ends as (status, backend, seconds, body)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.pool = ThreadPoolExecutor(8)
        self.started = 0
        self.lock = threading.Lock()

    def send(self, body: dict[str, Any]) -> Future[tuple[int, str | None, float, str]]:
        return self.pool.submit(self._one, body)

    def _one(self, body: dict[str, Any]) -> tuple[int, str | None, float, str]:
        began = time.monotonic()
        url = self.gw.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            parts = response.iter_raw()
            first = next(parts, b"")
            with self.lock:
                self.started += 1
            try:
                rest = b"".join(parts)
            except httpx.HTTPError:  # a stream cut by a backend that died
                rest = b""
            text = (first + rest).decode(errors="replace")
            backend = response.headers.get("x-kneecap-backend")
            return response.status_code, backend, time.monotonic() - began, text

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def ended(future: Future[Any], timeout: float, what: str) -> Any:
    try:
        wait_until(future.done, timeout)
    except TimeoutError:
        raise AssertionError(f"{what}: no answer within {timeout}s") from None
    return future.result()


def poke(raw: Proc) -> None:
    assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200


def depth(gw: Gateway, pool: str = "short") -> int:
    return gw.state()["pools"][pool]["queue_depth"]


def in_flight(gw: Gateway, name: str) -> int:
    return sum(b["in_flight"] for b in gw.state()["backends"] if b["name"] == name)


def two_pools(short_url: str, long_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "listen": QUICK_STOP,
        "pools": POOLS,
        "backends": [
            backend("s1", short_url, "short", limit=static(1)),
            backend("l1", long_url, "long", limit=static(1)),
        ],
        "health": QUIET_HEALTH,
        "routing": NO_BUDGET,
        **extra,
    }


def queue_behind_held(gw: Gateway, clients: Clients) -> tuple[Future[Any], Future[Any]]:
    """A held stream on s1 (its limit is 1), then a chat waiting in `short`'s queue."""
    held = clients.send(held_chat())
    wait_until(lambda: clients.started == 1 and in_flight(gw, "s1") == 1)
    waiting = clients.send(quick_chat())
    wait_until(lambda: depth(gw) == 1)
    return held, waiting


@pytest.mark.parametrize("spill", [True, False], ids=["spill", "no-spill"])
def test_a_waiter_whose_pool_lost_its_backends_goes_where_a_newcomer_would(
    tmp_path: Path, raw: Proc, spill: bool
) -> None:
    """A reload re-addresses the only `short` backend to a dead address. The waiter slept
    its whole deadline (spill on: `long` lends only idle headroom, which a limit of 1 never
    has) or was refused 503 (spill off) while a request arriving then was served on `long`."""
    routing = {**NO_BUDGET, "spill": {"to_longer": spill}}
    config = two_pools(raw.url, raw.url, routing=routing)
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        held, waiting = queue_behind_held(gw, clients)
        dead = f"http://127.0.0.1:{free_port()}"
        moved = [backend("s1", dead, "short", limit=static(1)), config["backends"][1]]
        reload(gw, {**config, "backends": moved})
        status, served_by, _, body = ended(waiting, SOON_S, "the waiter of the emptied pool")
        assert (status, served_by) == (200, "l1"), body
        assert depth(gw) == 0
        poke(raw)
        assert ended(held, SOON_S, "the held stream")[0] == 200
    finally:
        gw.proc.stop()
        clients.close()


def test_a_waiter_whose_pool_crashed_is_served_on_the_lender(tmp_path: Path) -> None:
    """The `short` backend dies with a request queued for it and `long` idle: the waiter got
    429 queue_timeout (or 502, its attempt on the dead backend failed) after its deadline."""
    short, long = start_raw_sse(tmp_path), start_raw_sse(tmp_path)
    config = two_pools(short.url, long.url, health={"interval_s": 0.2, "timeout_s": 0.5})
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        _, waiting = queue_behind_held(gw, clients)
        short.kill()
        status, served_by, _, body = ended(waiting, SOON_S, "the waiter of the crashed pool")
        assert (status, served_by) == (200, "l1"), body
    finally:
        gw.proc.stop()
        clients.close()
        short.stop()
        long.stop()


def test_a_waiter_nothing_serves_any_more_is_refused_at_once(tmp_path: Path, raw: Proc) -> None:
    """The reload leaves no backend of the model: 503 no_healthy_backend, not a sleep."""
    config = two_pools(raw.url, raw.url)
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        held, waiting = queue_behind_held(gw, clients)
        other = backend("l1", raw.url, "long", limit=static(1), models=["other"])
        reload(gw, {**config, "backends": [other]})
        status, _, _, body = ended(waiting, SOON_S, "the waiter nothing serves")
        assert status == 503 and json.loads(body)["error"]["code"] == "no_healthy_backend", body
        poke(raw)
        ended(held, SOON_S, "the held stream")
    finally:
        gw.proc.stop()
        clients.close()


def test_removing_a_lender_pool_leaves_its_borrowers_queued_then_served(
    tmp_path: Path, raw: Proc
) -> None:
    """The waiter's plan names `long` as a lender; the reload removed it: its queue was
    gone, and every waiter was answered 500 (KeyError looking it up)."""
    config = two_pools(raw.url, raw.url)
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        held, waiting = queue_behind_held(gw, clients)
        reload(
            gw, {**config, "pools": {"short": POOLS["short"]}, "backends": config["backends"][:1]}
        )
        assert set(gw.state()["pools"]) == {"short"}
        assert depth(gw) == 1 and not waiting.done()  # s1 is still busy: it waits
        poke(raw)
        assert ended(held, SOON_S, "the held stream")[0] == 200
        status, served_by, _, body = ended(waiting, SOON_S, "the waiter")
        assert (status, served_by) == (200, "s1"), body
    finally:
        gw.proc.stop()
        clients.close()


def rejected(gw: Gateway, pool: str) -> dict[str, float] | None:
    """The pool's rejection counters by reason as one exposition shows them (a scrape)."""
    found: dict[str, float] = {}
    prefix = f'kneecap_rejected_requests_total{{pool="{pool}",reason="'
    for line in httpx.get(gw.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            reason, value = line[len(prefix) :].split('"} ')
            found[reason] = float(value)
    return found or None


def test_a_removed_pool_shows_its_last_rejections_before_its_series_go(
    tmp_path: Path, raw: Proc
) -> None:
    """Two waiters of `short` are refused when a reload removes the pool and what served
    them; its series went at the first scrape after its last lease ended, so that scrape
    never showed the two rejections."""
    config = two_pools(raw.url, raw.url)
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        held = clients.send(held_chat())
        wait_until(lambda: clients.started == 1 and in_flight(gw, "s1") == 1)
        waiting = [clients.send(quick_chat()) for _ in range(2)]
        wait_until(lambda: depth(gw) == 2)
        assert rejected(gw, "short") == dict.fromkeys(REJECT_REASONS, 0.0)
        other = backend("l1", raw.url, "long", limit=static(1), models=["other"])
        reload(gw, {**config, "pools": {"long": POOLS["long"]}, "backends": [other]})
        for future in waiting:
            assert ended(future, SOON_S, "a waiter of the removed pool")[0] == 503
        poke(raw)  # the held stream's lease, the pool's last, ends
        ended(held, SOON_S, "the held stream")
        wait_until(lambda: gw.state()["pools"]["short"]["leased"] == 0)
        shown = rejected(gw, "short")  # this scrape drops the pool's queue
        assert shown is not None and shown["no_backend"] == 2, shown
        assert "short" not in gw.state()["pools"]
        assert rejected(gw, "short") is None  # shown once: the next scrape has them gone
    finally:
        gw.proc.stop()
        clients.close()


def test_a_waiter_planned_onto_another_pool_hears_of_its_releases(tmp_path: Path) -> None:
    """Spill off: a release in `long` wakes no other pool's queue, so a waiter of `short`
    planned onto `long` (its own backend gone) is woken by the next control tick."""
    short, long = start_raw_sse(tmp_path), start_raw_sse(tmp_path)
    routing = {**NO_BUDGET, "spill": {"to_longer": False}}
    config = two_pools(short.url, long.url, routing=routing)
    gw = start_gateway(tmp_path, config)
    clients = Clients(gw)
    try:
        held_short, waiting = queue_behind_held(gw, clients)
        long_prompt = [{"role": "user", "content": "abcd" * 9000}]  # about 9000 tokens
        held_long = clients.send({**held_chat(), "messages": long_prompt})
        wait_until(lambda: clients.started == 2 and in_flight(gw, "l1") == 1)
        dead = f"http://127.0.0.1:{free_port()}"
        moved = [backend("s1", dead, "short", limit=static(1)), config["backends"][1]]
        reload(gw, {**config, "backends": moved})
        probed = {"url": dead, "healthy": False}
        wait_until(lambda: any(probed.items() <= b.items() for b in gw.state()["backends"]))
        assert depth(gw) == 1 and not waiting.done()  # planned onto `long`, where l1 is busy
        poke(long)
        assert ended(held_long, SOON_S, "the held stream on l1")[0] == 200
        status, served_by, _, body = ended(waiting, SOON_S, "the waiter planned onto `long`")
        assert (status, served_by) == (200, "l1"), body
        poke(short)
        ended(held_short, SOON_S, "the held stream on s1")
    finally:
        gw.proc.stop()
        clients.close()
        short.stop()
        long.stop()
