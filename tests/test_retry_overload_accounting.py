"""A request whose first attempt fails on backend A and whose retry on B then meets the
gateway's own shortage: what the client hears and what the operator reads.

The client gets 503 ``gateway_overloaded`` (the reason it was not retried further, with
``Retry-After``); the request is counted once, on A, with the failure it really had
(``upstream_error``, its record A's attempt's: ``upstream_s`` when A had the request),
never also as a rejection; the retry, which never went out, is no
retry in ``kneecap_upstream_retries_total``; A's failure counts for its health, B is not
blamed, and no permit is left taken.

The shortages are real: no descriptor left to the gateway process (``prlimit``, A
answering 503 on a connection kept alive from before), and no local port left to B (a
network namespace of its own with a two-port ephemeral range, A refusing connections).
"""

from __future__ import annotations

import json
import resource
import textwrap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import port_range
from tests.port_range import in_own_network_namespace
from tests.procs import Gateway, Proc, start_gateway, start_raw_sse, wait_until
from tests.raw_sse_backend import MODEL
from tests.test_gauges_truth import value_in
from tests.test_overload_more import _own_network_namespace
from tests.test_proxy_front_fixes import _open_descriptors, run_scenario
from tests.test_proxy_wire import idle, metric_sum, new_id, record_of
from tests.test_retry_accounting import Held, error_answer, raw_entry

CHAT = "/v1/chat/completions"
MANY = {"kind": "static", "initial": 8, "min": 8, "max": 8}  # nothing ever queues
OWN_LIMIT = "the gateway's own limit"
_COMPLETION = json.dumps({"object": "chat.completion", "choices": []})
OK_ANSWER = [
    "send",
    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    f"content-length: {len(_COMPLETION)}\r\n\r\n{_COMPLETION}",
]

ASK = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}

Starve = Callable[[Gateway, Proc], AbstractContextManager[None]]


@contextmanager
def no_descriptor_left(gw: Gateway, _: Proc) -> Iterator[None]:
    """The gateway process can open no new descriptor; those it has stay usable."""
    pid = gw.proc.pid
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = _open_descriptors(pid)
    lowest_free = min(fd for fd in range(len(used) + 1) if fd not in used)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def no_local_port_to(_: Gateway, target: Proc) -> Iterator[None]:
    """Every local port to ``target`` taken (only in a network namespace of one's own):
    a port to any other address is still free."""
    with port_range.no_local_port_to(("127.0.0.1", int(target.url.rsplit(":", 1)[1]))):
        yield


def counters(client: httpx.Client) -> dict[str, float]:
    """Read on the client's kept-alive connection: a connection of its own, closed just
    before the shortage, would free the gateway a descriptor a moment later."""
    shown = client.get("/metrics").text
    names = {
        "requests": "kneecap_requests_total",
        "rejected": "kneecap_rejected_requests_total",
        "retries": "kneecap_upstream_retries_total",
    }
    return {key: value_in(shown, name) or 0.0 for key, name in names.items()}


def overloaded_retry(tmp: Path, starve: Starve, *, a_refuses: bool) -> dict[str, Any]:
    """The scenario, its facts gathered for the caller to assert on (it may run in a
    namespace of its own, in another process)."""
    raws = {"a": start_raw_sse(tmp), "b": start_raw_sse(tmp)}
    config = {
        "backends": [{**raw_entry(name, proc), "limit": MANY} for name, proc in raws.items()],
        # One failure ejects: A's is seen as one; B, never failed, must stay in.
        "health": {"interval_s": 60, "failure_threshold": 1},
        # Deterministic: the request goes to the backend not held, its retry to the held.
        "routing": {"policy": "least_loaded"},
        "upstream": {"max_attempts": 3, "connect_timeout_s": 2},
        # No scrape of the engines' /metrics opens or closes a descriptor meanwhile.
        "measurement": {"scrape_interval_s": 3600},
    }
    gw = start_gateway(tmp, config)
    client = httpx.Client(base_url=gw.url, timeout=15)  # connected before any shortage
    held: Held | None = None

    def probed() -> bool:
        return all(b["healthy"] for b in client.get("/admin/state").json()["backends"])

    try:
        wait_until(probed, timeout=10)
        held = Held(gw, raws)  # B: its one connection in use, the retry needs a new one
        b = held.backend
        a = next(name for name in raws if name != b)
        warm = client.post(CHAT, json={**ASK, "raw_script": [OK_ANSWER]})
        assert (warm.status_code, warm.headers.get("x-kneecap-backend")) == (200, a), warm.text
        if a_refuses:
            raws[a].stop()  # its port refuses: nothing listens there any more
        before = counters(client)
        request_id = new_id("overloaded-retry")
        body = {
            **ASK,
            # Answered before any byte of a body: a 5xx the gateway retries.
            "raw_script": [error_answer(503, "Service Unavailable")],
        }
        with starve(gw, raws[b]):
            answer = client.post(CHAT, json=body, headers={"x-request-id": request_id})
        record = record_of(gw, request_id)
        after = counters(client)
        state = gw.state()
        by_backend = {
            name: {
                status: metric_sum(gw.url, "kneecap_requests_total", backend=name, status=status)
                for status in ("upstream_error", "ok")
            }
            for name in raws
        }
        rejected = metric_sum(
            gw.url, "kneecap_rejected_requests_total", reason="gateway_overloaded"
        )
        held.release()
        held = None
        wait_until(lambda: idle(gw), timeout=10)
        return {
            "a": a,
            "b": b,
            "status": answer.status_code,
            "retry_after": answer.headers.get("retry-after"),
            "body": answer.json(),
            "record": record,
            "delta": {key: after[key] - before[key] for key in before},
            "by_backend": by_backend,
            "overloaded": rejected,
            "healthy": {be["name"]: be["healthy"] for be in state["backends"]},
            "in_flight": {be["name"]: be["in_flight"] for be in state["backends"]},
            "leased": state["pools"]["short"]["leased"],
            "output": gw.proc.output(),
        }
    finally:
        if held is not None:
            held.release()
        client.close()
        gw.proc.stop()
        for proc in raws.values():
            proc.stop()


def assert_accounted_once_on_a(facts: dict[str, Any]) -> None:
    a, b = facts["a"], facts["b"]
    # The client hears why it was not retried further: the gateway's shortage.
    assert facts["status"] == 503, facts["body"]
    error = facts["body"]["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "gateway_overloaded")
    assert facts["retry_after"] == "1"
    # One record, on the backend that failed it, with the failure it had.
    record = facts["record"]
    assert (record["backend"], record["status"]) == (a, "upstream_error")
    # Counted once: in the requests, not also as a rejection; its retry never went out.
    assert facts["delta"] == {"requests": 1.0, "rejected": 0.0, "retries": 0.0}
    assert facts["by_backend"][a] == {"upstream_error": 1.0, "ok": 1.0}  # ok: the warm-up
    assert facts["by_backend"][b] == {"upstream_error": 0.0, "ok": 0.0}
    assert facts["overloaded"] == 0.0
    # A's failure counts for its health (one ejects here); B is not blamed.
    assert facts["healthy"] == {a: False, b: True}
    assert f"backend {a} is DOWN" in facts["output"]
    assert f"backend {b} is DOWN" not in facts["output"]
    assert OWN_LIMIT in facts["output"]  # the operator is told of the shortage all the same
    # No permit left taken: only the held stream's, until it ended (then idle()).
    assert facts["in_flight"] == {a: 0, b: 1}
    assert facts["leased"] == 1


def assert_written_to_a(facts: dict[str, Any], written: bool) -> None:
    """The record is A's attempt's: its upstream_s (receipt to the request written to A)
    is there when A had the request, as on any request that ended on A."""
    record = facts["record"]
    if not written:
        assert (record["upstream_s"], record["overhead_s"]) == (None, None)
        return
    assert record["upstream_s"] is not None and record["overhead_s"] is not None, record
    assert 0 < record["upstream_s"] <= record["e2e_s"]
    assert 0 <= record["overhead_s"] <= record["upstream_s"]


def test_a_503_then_no_descriptor_for_the_retry_is_counted_once_on_the_failing_backend(
    tmp_path: Path,
) -> None:
    """A answers 503 on a connection kept alive from the warm-up; the retry to B finds no
    descriptor for a new one (before: the retry counted in
    kneecap_upstream_retries_total, though it never went out, and the record on A had no
    upstream_s, though A had the request)."""
    facts = overloaded_retry(tmp_path, no_descriptor_left, a_refuses=False)
    assert "Too many open files" in facts["body"]["error"]["message"]
    assert_accounted_once_on_a(facts)
    assert_written_to_a(facts, written=True)


_IN_OWN_NAMESPACE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from tests.test_retry_overload_accounting import no_local_port_to, overloaded_retry
    facts = overloaded_retry(Path(sys.argv[1]), no_local_port_to, a_refuses=True)
    print(json.dumps(facts))
    """
)


@pytest.mark.skipif(not _own_network_namespace(), reason="needs `unshare -n` and `ip`")
def test_a_refused_connection_then_no_local_port_for_the_retry_is_counted_once(
    tmp_path: Path,
) -> None:
    """A refuses the connection; the retry to B finds no local port left to it."""
    facts, _ = run_scenario(
        in_own_network_namespace(_IN_OWN_NAMESPACE, str(tmp_path)),
        timeout=120,
    )
    assert "Cannot assign requested address" in facts["body"]["error"]["message"]
    assert_accounted_once_on_a(facts)
    assert_written_to_a(facts, written=False)  # refused: A never had it
