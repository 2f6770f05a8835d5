"""What a reload keeps of a backend it changes: the models it serves when its ``models``
key is dropped, and its replica (requests in flight, limit) when it is renamed at the
same URL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.pool import BackendSet
from backends.replica import Replica
from gateway.control import LimitLoop
from gateway.settings import BackendConfig
from policies.static import StaticLimitConfig
from tests.procs import MODEL, Proc, backend, served, start_gateway, start_sim, wait_until
from tests.test_limit_static import CONFIG

URL = "http://127.0.0.1:9"
STATIC_2 = {"kind": "static", "initial": 2, "min": 1, "max": 2}


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path, ttft_ms=2, itl_ms=20))


def test_a_kept_backend_whose_models_are_dropped_serves_them_until_probed() -> None:
    # It served none until its next probe answered: requests got 404 model_not_found.
    before = BackendSet.build([BackendConfig(name="a", url=URL, models=(MODEL,))])
    (replica,) = before.replicas
    replica.healthy = replica.probed = True
    after = BackendSet.build([BackendConfig(name="a", url=URL)], before)
    assert after.replicas == (replica,)
    assert replica.serves(MODEL) and after.healthy_models() == [MODEL]


def test_a_kept_backend_whose_models_are_dropped_answers_at_once(tmp_path: Path, sim: Proc) -> None:
    quiet = {"interval_s": 30}  # only the probe the reload starts refreshes its models
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url)], "health": quiet})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        wait_until(lambda: gw.state()["backends"][0]["healthy"])
        gw.write_config({**gw.config, "backends": [{"name": "a", "url": sim.url}]})
        with httpx.Client(base_url=gw.url, timeout=10) as client:
            assert client.post("/admin/reload").status_code == 200
            statuses = [client.post("/v1/completions", json=body).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        wait_until(lambda: gw.state()["backends"][0]["models"] == [MODEL])
    finally:
        gw.proc.stop()


def test_a_backend_renamed_at_its_url_keeps_its_requests_in_flight(
    tmp_path: Path, sim: Proc
) -> None:
    # The old name drained its requests while the new one admitted a whole limit beside
    # them: the engine ran 4 on a limit of 2.
    gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url, limit=STATIC_2)]})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 300, "stream": True, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
            r.read()

    threads = [threading.Thread(target=stream) for _ in range(4)]
    try:
        wait_until(lambda: gw.state()["backends"][0]["healthy"])
        for t in threads[:2]:
            t.start()
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 2)
        gw.write_config({**gw.config, "backends": [backend("b", sim.url, limit=STATIC_2)]})
        assert httpx.post(gw.url + "/admin/reload", timeout=5).status_code == 200
        listed = [(b["name"], b["in_flight"], b["draining"]) for b in gw.state()["backends"]]
        assert listed == [("b", 2, False)]  # none left draining under the old name
        for t in threads[2:]:
            t.start()
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 2)  # they wait
        assert gw.state()["backends"][0]["in_flight"] == 2
        for t in threads:
            t.join(60)
        assert gw.state()["backends"][0]["in_flight"] == 0
    finally:
        gw.proc.stop()


def test_a_renamed_backend_keeps_its_controller_and_a_re_addressed_one_starts_afresh() -> None:
    """Controllers were kept by name: a rename at the same URL (the same replica, the same
    engine) lost what its controller had, and a new engine at a re-used name inherited it.
    Here the rename comes with a switch from static to gradient: a carried controller
    hands its limit over; a fresh gradient one starts at its ``min``."""
    url = "http://127.0.0.1:9"
    replica = Replica(config=BackendConfig(name="a", url=url, models=[MODEL]), url=url)
    loop = LimitLoop()
    loop.sync([replica], lambda _: StaticLimitConfig(initial=32))
    assert replica.limit == 32
    gradient = CONFIG.validate_python({"kind": "gradient", "min": 3})
    replica.config = BackendConfig(name="a-renamed", url=url, models=[MODEL])
    loop.sync([replica], lambda _: gradient)
    assert replica.limit == 32  # before: 3, a controller new to it
    elsewhere = "http://127.0.0.1:10"
    config = BackendConfig(name="a-renamed", url=elsewhere, models=[MODEL])
    moved = Replica(config=config, url=elsewhere)
    loop.sync([moved], lambda _: gradient)
    assert moved.limit == 3  # another engine: nothing learned of it yet
