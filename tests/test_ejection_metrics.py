"""``kneecap_backend_ejections_total{backend, reason}``: each time a backend in rotation is
taken out, read from a real gateway's ``/metrics``. Before, an operator saw
``kneecap_backend_up`` drop to 0 and nothing of why: failed requests (passive ejection) or
a failed health probe. Both series of each configured backend exist at 0 from the start,
so ``increase()`` sees the first ejection, and go with a backend a reload removes."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, render
from tests.procs import Gateway, backend, free_port, start_gateway, start_sim, wait_until
from tests.test_ops_robustness import start_ops_backend
from tests.test_passive_ejection_hold import (
    COMPLETION,
    failing_beside_a_good_one,
    healthy,
    probe_rounds,
    reload,
)

EJECTIONS = "kneecap_backend_ejections_total"
Counts = dict[tuple[str, str], float]


def ejections_in(exposition: str) -> Counts:
    """(backend, reason) -> count, for every series of the ejection counter."""
    return {
        (s.labels["backend"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name == EJECTIONS
    }


def ejections(gw: Gateway) -> Counts:
    """One scrape of the gateway (each one may drop a removed backend's series)."""
    return ejections_in(httpx.get(gw.url + "/metrics", timeout=5).text)


def zero(*backends: str) -> Counts:
    return {(b, r): 0.0 for b in backends for r in ("failed_requests", "probe_failed")}


def test_failed_requests_count_one_passive_ejection(tmp_path: Path) -> None:
    good, bad, config = failing_beside_a_good_one(tmp_path)
    gw = start_gateway(tmp_path, config)
    try:
        assert ejections(gw) == zero("bad", "good")  # before any: there, at 0
        with httpx.Client(base_url=gw.url, timeout=10) as client:
            for _ in range(2):  # failure_threshold
                assert client.post("/v1/completions", json=COMPLETION).status_code == 500
        assert healthy(gw) == {"bad": False, "good": True}
        assert ejections(gw) == {**zero("bad", "good"), ("bad", "failed_requests"): 1.0}
        # Probes answered 200 during its hold: ignored, neither a readmission nor a second
        # ejection (nor a probe_failed one).
        probe_rounds(bad, 3)
        assert ejections(gw) == {**zero("bad", "good"), ("bad", "failed_requests"): 1.0}
    finally:
        gw.proc.stop()
        bad.stop()
        good.stop()


def test_a_failing_probe_counts_once_per_time_a_backend_leaves_rotation(
    tmp_path: Path,
) -> None:
    port = free_port()
    dying = start_sim(tmp_path, port=port, ttft_ms=1, itl_ms=1)
    steady = start_ops_backend(tmp_path)  # counts the probes that reach it
    config = {
        "backends": [backend("dying", dying.url), backend("steady", steady.url)],
        "health": {"interval_s": 0.1},
    }
    gw = start_gateway(tmp_path, config)
    try:
        wait_until(lambda: healthy(gw) == {"dying": True, "steady": True})
        assert ejections(gw) == zero("dying", "steady")
        dying.stop()  # the sim this test started, by its PID
        wait_until(lambda: healthy(gw)["dying"] is False)
        once = {**zero("dying", "steady"), ("dying", "probe_failed"): 1.0}
        assert ejections(gw) == once
        # More failed probes of a backend already out take nothing more out.
        probe_rounds(steady, 3)
        assert ejections(gw) == once
        # Back, then gone again: a second time out of rotation.
        dying = start_sim(tmp_path, port=port, ttft_ms=1, itl_ms=1)
        wait_until(lambda: healthy(gw)["dying"] is True)
        assert ejections(gw) == once
        dying.stop()
        wait_until(lambda: healthy(gw)["dying"] is False)
        assert ejections(gw) == {**once, ("dying", "probe_failed"): 2.0}
    finally:
        gw.proc.stop()
        dying.stop()
        steady.stop()


def test_a_backend_a_reload_removes_loses_its_ejection_series(tmp_path: Path) -> None:
    first, second = (start_sim(tmp_path, ttft_ms=1, itl_ms=1) for _ in range(2))
    config = {
        "backends": [backend("kept", first.url), backend("removed", second.url)],
        "health": {"interval_s": 0.1},
    }
    gw = start_gateway(tmp_path, config)
    try:
        assert ejections(gw) == zero("kept", "removed")
        reload(gw, {**config, "backends": [backend("kept", first.url)]})
        # Like its other series: shown drained by one scrape, gone at the next.
        wait_until(lambda: ejections(gw) == zero("kept"))
    finally:
        gw.proc.stop()
        first.stop()
        second.stop()


def test_an_ejection_reported_for_a_removed_backend_brings_no_series_back() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.register_backend("a", "short")
    metrics.observe_ejection("a", "probe_failed")
    metrics.remove_backend("a")
    metrics.observe_ejection("a", "failed_requests")  # a late report
    assert "a" not in metrics.backends()
    metrics.register_backend("a", "long")  # added back: from zero
    body, _ = render(registry)
    assert ejections_in(body.decode()) == zero("a")
