"""Passive ejection holds, as Envoy's outlier detection does: a backend that fails its
requests while its ``/health`` says 200 stays out for an ejection time that grows with its
ejections in a row, whatever its probes say meanwhile (before, the next probe readmitted it
and it failed ``failure_threshold`` more requests every ``interval_s``, for ever). And
passive ejection never takes out the last backends a pool has: requests that fail
everywhere must not empty it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.health import probe_all
from backends.pool import BackendSet
from backends.replica import Replica, ejection_time, ejections_in_a_row, install_rotations
from gateway.settings import BackendConfig, HealthConfig
from tests.procs import MODEL, Gateway, Proc, backend, start_gateway, start_sim, wait_until
from tests.test_ops_robustness import counts, start_ops_backend

COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 1}
ENGINE_FAILURE = {"error": {"message": "engine failed"}}  # tests.ops_backend's own 500


def healthy(gw: Gateway) -> dict[str, bool]:
    return {b["name"]: b["healthy"] for b in gw.state()["backends"]}


def reload(gw: Gateway, config: dict[str, Any]) -> None:
    gw.write_config(config)
    answer = httpx.post(gw.url + "/admin/reload", timeout=5).json()
    assert answer["ok"] is True, answer


def probe_rounds(proc: Proc, rounds: int) -> None:
    """Until ``rounds`` more probes reached ``proc`` and were answered 200 (each asks its
    ``/health`` then its ``/v1/models``, which the ops backend counts)."""
    seen = counts(proc)["model_listings"]
    wait_until(lambda: counts(proc)["model_listings"] >= seen + rounds)


# --- through the gateway -------------------------------------------------------------


def failing_beside_a_good_one(tmp_path: Path) -> tuple[Proc, Proc, dict[str, Any]]:
    """A sim, and a backend up by its /health that answers 500 to every request, which
    the config tries first; two failures eject it, and every request has one attempt."""
    good = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    bad = start_ops_backend(tmp_path, post_status=500)
    config = {
        "backends": [backend("bad", bad.url), backend("good", good.url)],
        "health": {"interval_s": 0.1, "failure_threshold": 2},
        "upstream": {"max_attempts": 1},
        "routing": {"policy": "least_loaded"},  # deterministic: `bad` first on ties
    }
    return good, bad, config


def test_a_backend_failing_every_request_stays_out_while_its_health_says_200(
    tmp_path: Path,
) -> None:
    good, bad, config = failing_beside_a_good_one(tmp_path)
    gw = start_gateway(tmp_path, config)
    try:
        with httpx.Client(base_url=gw.url, timeout=10) as client:
            for _ in range(2):
                answer = client.post("/v1/completions", json=COMPLETION)
                assert (answer.status_code, answer.json()) == (500, ENGINE_FAILURE)
            assert healthy(gw) == {"bad": False, "good": True}
            probe_rounds(bad, 3)  # before, the first of them readmitted it
            # A reload keeps the replica, its ejection with it.
            reload(gw, {**config, "health": {**config["health"], "ejection_s": 60}})
            probe_rounds(bad, 3)
            for _ in range(10):
                answer = client.post("/v1/completions", json=COMPLETION)
                assert (answer.status_code, answer.headers["x-kneecap-backend"]) == (200, "good")
        assert counts(bad)["posts"] == 2
        assert healthy(gw) == {"bad": False, "good": True}
        views = {b["name"]: b["ejection"] for b in gw.state()["backends"]}
        assert views["good"] is None
        ejection = views["bad"]
        assert ejection["reason"] == "2 failed requests in a row", ejection
        assert ejection["ejections_in_a_row"] == 1 and 0 < ejection["remaining_s"] <= 30
    finally:
        gw.proc.stop()
        bad.stop()
        good.stop()


def test_a_backend_renamed_while_ejected_is_probed_afresh(tmp_path: Path) -> None:
    """A rename at the same URL makes the backend new to its probes, which requests for its
    model wait on; its ejection, kept, made every probe ignored for the whole hold, and
    those requests sat out their queue deadlines."""
    good, bad, config = failing_beside_a_good_one(tmp_path)
    gw = start_gateway(tmp_path, config)
    try:
        for _ in range(2):
            answer = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)
            assert answer.status_code == 500
        assert healthy(gw) == {"bad": False, "good": True}
        renamed = {**config, "backends": [backend("bad2", bad.url), backend("good", good.url)]}
        reload(gw, renamed)
        # Its /health says 200: the first probe after the rename takes it back in.
        wait_until(lambda: healthy(gw) == {"bad2": True, "good": True}, timeout=10)
        views = {b["name"]: b["ejection"] for b in gw.state()["backends"]}
        assert views == {"bad2": None, "good": None}
    finally:
        gw.proc.stop()
        bad.stop()
        good.stop()


def test_the_last_backend_in_rotation_is_never_ejected(tmp_path: Path) -> None:
    """Alone in its pool, a backend failing every request stays in: its clients get the
    engine's own 500, not 503 for ``ejection_s`` and more."""
    broken = start_ops_backend(tmp_path, post_status=500)
    config = {
        "backends": [backend("broken", broken.url)],
        "health": {"interval_s": 60, "failure_threshold": 2},
        "upstream": {"max_attempts": 1},
    }
    gw = start_gateway(tmp_path, config)
    try:
        for _ in range(4):
            answer = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)
            assert (answer.status_code, answer.json()) == (500, ENGINE_FAILURE)
        assert healthy(gw) == {"broken": True}
        assert counts(broken)["posts"] == 4
    finally:
        gw.proc.stop()
        broken.stop()


@pytest.mark.parametrize(("percent", "ejected"), [(0, 0), (50, 1), (100, 2)])
def test_requests_failing_everywhere_eject_at_most_the_pools_share(
    tmp_path: Path, percent: int, ejected: int
) -> None:
    """Three requests that every replica answers 500 (a crash on one bad input), each
    retried on all three: before, they ejected the whole pool and every client got 503.
    Now at most ``max_ejection_percent`` of it goes (rounded down), never the last one."""
    procs = [start_ops_backend(tmp_path, post_status=500) for _ in range(3)]
    config = {
        "backends": [backend(f"r{i}", p.url) for i, p in enumerate(procs)],
        "health": {"interval_s": 60, "failure_threshold": 3, "max_ejection_percent": percent},
        "upstream": {"max_attempts": 3},
    }
    gw = start_gateway(tmp_path, config)
    try:
        for _ in range(3):
            answer = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)
            assert (answer.status_code, answer.json()) == (500, ENGINE_FAILURE)
        assert sum(counts(p)["posts"] for p in procs) == 9  # each tried on all three
        assert list(healthy(gw).values()).count(False) == ejected
        answer = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=10)
        assert (answer.status_code, answer.json()) == (500, ENGINE_FAILURE)  # not 503
    finally:
        gw.proc.stop()
        for proc in procs:
            proc.stop()


# --- the arithmetic ------------------------------------------------------------------


def test_each_ejection_in_a_row_lasts_longer_up_to_the_cap() -> None:
    config = HealthConfig(ejection_s=30, max_ejection_s=100)
    assert [ejection_time(n, config) for n in (1, 2, 3, 4, 9)] == [30, 60, 90, 100, 100]


def test_ejections_in_a_row_decay_while_the_backend_holds_up() -> None:
    config = HealthConfig(ejection_s=30, max_ejection_s=300)
    assert ejections_in_a_row(0, 0.0, config) == 1
    assert ejections_in_a_row(3, 29.9, config) == 4  # back too briefly: it grows
    assert ejections_in_a_row(3, 60.0, config) == 2  # 60 s in rotation: two steps down
    assert ejections_in_a_row(3, 1e6, config) == 1  # held up long: starts over
    assert ejections_in_a_row(10, 0.0, config) == 10  # 300 / 30: at the cap it stays


def test_ejection_times_must_be_finite_and_ordered() -> None:
    with pytest.raises(ValueError, match="max_ejection_s"):
        HealthConfig(ejection_s=60, max_ejection_s=30)
    with pytest.raises(ValueError, match="finite"):
        HealthConfig(max_ejection_s=float("inf"))
    with pytest.raises(ValueError, match="less than or equal to 100"):
        HealthConfig(max_ejection_percent=101)


def replica(name: str, *models: str, url: str = "http://127.0.0.1:9") -> Replica:
    return Replica(config=BackendConfig(name=name, url=url, models=models), url=url)


def in_rotation(*replicas: Replica, config: HealthConfig) -> None:
    for r in replicas:
        r.healthy = r.probed = True
    install_rotations(replicas, config, clock=lambda: 0.0)


def test_the_last_backend_of_a_model_stays_though_the_pool_has_others() -> None:
    a, b, c = replica("a", "x"), replica("b", "x", "y"), replica("c", "y")
    in_rotation(a, b, c, config=HealthConfig(failure_threshold=1, max_ejection_percent=100))
    b.record_failure(1)
    assert not b.healthy  # a serves x, c serves y
    c.record_failure(1)
    a.record_failure(1)
    assert c.healthy and a.healthy  # each the last in rotation for y, for x
    assert b.rotation is not None and "in rotation for y" in (b.rotation.refusal(c) or "")


def test_a_spared_backend_is_ejected_at_its_next_failure_once_it_may_be() -> None:
    a, b = replica("a", MODEL), replica("b", MODEL)
    in_rotation(a, b, config=HealthConfig(failure_threshold=2))
    for _ in range(2):
        a.record_failure(2)
        b.record_failure(2)
    assert (a.healthy, b.healthy) == (False, True)  # b is the last one
    a.readmitted(30.0)
    a.healthy = True  # as a probe after its ejection does
    b.record_failure(2)
    assert (a.healthy, b.healthy) == (True, False)


# --- readmission by the probes, in virtual time --------------------------------------


@pytest.fixture
def ops(tmp_path: Path) -> Iterator[Proc]:
    proc = start_ops_backend(tmp_path)  # /health 200, always
    yield proc
    proc.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_a_probe_readmits_only_once_the_ejection_is_over(ops: Proc) -> None:
    config = HealthConfig(failure_threshold=2, ejection_s=30, max_ejection_s=300)
    clock = Clock()
    backends = BackendSet.of([replica("a", MODEL, url=ops.url), replica("b", MODEL, url=ops.url)])
    a = backends.get("a")
    assert a is not None

    async with httpx.AsyncClient() as client:

        async def probe_at(now: float) -> None:
            clock.now = now
            await probe_all(client, backends, config, lambda r: None, clock)

        def fail_at(now: float) -> None:
            clock.now = now
            for _ in range(config.failure_threshold):
                a.record_failure(config.failure_threshold)

        await probe_at(0.0)
        assert a.healthy
        fail_at(1.0)
        assert not a.healthy
        assert a.ejection_view(1.0) == {
            "reason": "2 failed requests in a row",
            "ejections_in_a_row": 1,
            "remaining_s": 30.0,
        }
        await probe_at(30.9)
        assert not a.healthy  # its /health said 200: before, this readmitted it
        await probe_at(31.0)
        assert a.healthy and a.ejection_view(31.0) is None
        fail_at(32.0)  # failing again at once: twice as long
        assert a.ejection_view(32.0) == {
            "reason": "2 failed requests in a row",
            "ejections_in_a_row": 2,
            "remaining_s": 60.0,
        }
        await probe_at(91.9)
        assert not a.healthy
        await probe_at(92.0)
        assert a.healthy
        fail_at(92.0 + 60.0)  # 60 s in rotation: two steps down, then this one
        view = a.ejection_view(152.0)
        assert view is not None and (view["ejections_in_a_row"], view["remaining_s"]) == (1, 30)


@pytest.mark.anyio
async def test_a_probe_between_two_failed_requests_does_not_forgive_the_first(ops: Proc) -> None:
    """Before, every successful probe reset the count: a backend failing every request
    but getting fewer than ``failure_threshold`` of them per ``interval_s`` stayed in."""
    config = HealthConfig(failure_threshold=2)
    backends = BackendSet.of([replica("a", MODEL, url=ops.url), replica("b", MODEL, url=ops.url)])
    a = backends.get("a")
    assert a is not None
    async with httpx.AsyncClient() as client:
        await probe_all(client, backends, config, lambda r: None)
        a.record_failure(2)
        await probe_all(client, backends, config, lambda r: None)
        assert a.healthy
        a.record_failure(2)
        assert not a.healthy
