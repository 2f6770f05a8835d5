"""Proxied requests on the wire: real gateways and simulators over loopback.

What a client can do to an HTTP/1.1 connection (split head and body, ask for
``100 Continue``, pipeline, hang up at once, hang up while the backend works) must
not change the answer it gets, leak another client's answer to it, or leave a
permit, a queue place or an upstream request behind; and every request that
reached a backend is recorded exactly once, with the status that says what ended it.

The clients are the official ``openai`` client (httpx underneath) and raw sockets,
whose writes the test decides.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import httpx
import openai
import pytest

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    free_port,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.test_proxy_upstream_request import MODEL as ECHO_MODEL
from tests.test_proxy_upstream_request import echo_backend, start_echo

MESSAGES = [{"role": "user", "content": "Where is the knee?"}]
CHAT = "/v1/chat/completions"
STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}
JSON = {"content-type": "application/json"}


# --- raw HTTP/1.1 over a socket ---------------------------------------------------


def post_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    fields = {"host": "127.0.0.1", "content-type": "application/json", **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}).encode()


def address(gw: Gateway) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


class RawConnection:
    """One keep-alive connection; responses parsed as they come, pipelined or not."""

    def __init__(self, gw: Gateway) -> None:
        self.sock = socket.create_connection(address(gw), timeout=10)
        self.done: list[dict[str, Any]] = []
        self._current: dict[str, Any] = {}
        self._parser = httptools.HttpResponseParser(self)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def responses(self, count: int) -> list[dict[str, Any]]:
        """The next ``count`` responses (1xx included), read until they are complete."""
        while len(self.done) < count:
            data = self.sock.recv(65536)
            assert data, f"connection closed after {len(self.done)} of {count} responses"
            self._parser.feed_data(data)
        taken, self.done = self.done[:count], self.done[count:]
        return taken

    def close(self) -> None:
        self.sock.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self._current["status"] = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._current["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self._current)


# --- the gateway's and the simulator's own views ------------------------------------


def admin_headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def records(gw: Gateway, token: str | None = None) -> list[dict[str, Any]]:
    listing = httpx.get(
        gw.url + "/admin/requests?limit=256", headers=admin_headers(token), timeout=5
    )
    return listing.json()["requests"]


def record_of(gw: Gateway, request_id: str, token: str | None = None) -> dict[str, Any]:
    """The request's entry in /admin/requests, once recorded (the relay's end is batched)."""
    found: list[dict[str, Any]] = []

    def recorded() -> bool:
        found[:] = [r for r in records(gw, token) if r["request_id"] == request_id]
        return bool(found)

    wait_until(recorded, timeout=10)
    assert len(found) == 1, found
    return found[0]


def metric_sum(url: str, name: str, token: str | None = None, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", headers=admin_headers(token), timeout=5).text
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        found = match.group(1) or ""
        if all(f'{k}="{v}"' in found for k, v in labels.items()):
            total += float(match.group(2))
    return total


def requests_total(gw: Gateway, token: str | None = None, **labels: str) -> float:
    return metric_sum(gw.url, "kneecap_requests_total", token, **labels)


def rejected(gw: Gateway, reason: str, token: str | None = None) -> float:
    return metric_sum(gw.url, "kneecap_rejected_requests_total", token, reason=reason)


def idle(gw: Gateway, token: str | None = None) -> bool:
    state = gw.state(token)
    return all(b["in_flight"] == 0 for b in state["backends"]) and all(
        p == {"queue_depth": 0, "leased": 0} for p in state["pools"].values()
    )


def sim_running(sim: Proc) -> int:
    return int(metric_sum(sim.url, "vllm:num_requests_running"))


def sim_prompt_tokens(sim: Proc) -> int:
    """The simulator adds a request's prompt tokens once, when its generation starts:
    divided by a fixed prompt size, an exact count of requests it started."""
    return int(metric_sum(sim.url, "vllm:prompt_tokens_total"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def direct(sim: Proc, body: bytes) -> httpx.Response:
    return httpx.post(sim.url + CHAT, content=body, headers=JSON, timeout=10)


def openai_client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30)


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wire")


@pytest.fixture(scope="module")
def fast_sim(module_tmp: Path) -> Iterator[Proc]:
    sim = start_sim(module_tmp, ttft_ms=5, itl_ms=2)
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def wire_gw(module_tmp: Path, fast_sim: Proc) -> Iterator[Gateway]:
    """One backend: every request shares its upstream connection pool."""
    gw = start_gateway(module_tmp, {"backends": [backend("s", fast_sim.url)]})
    try:
        yield gw
    finally:
        gw.proc.stop()


# --- 1. the official client -------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_openai_client_gets_the_backends_answer_and_a_timed_record(
    wire_gw: Gateway, fast_sim: Proc, stream: bool
) -> None:
    """The gateway must not change the answer (same seed, same text as asking the
    simulator directly), and its record must put the upstream write between receipt
    and the end, after admission: a zero, a missing or a misplaced stamp fails."""
    client = openai_client(wire_gw.url)
    straight = openai_client(fast_sim.url)
    asked = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "seed": 11}
    request_id = new_id("openai")
    if stream:
        chunks = list(
            client.chat.completions.create(
                **asked, stream=True, extra_headers={"x-request-id": request_id}
            )
        )
        expected = list(straight.chat.completions.create(**asked, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = "".join(c.choices[0].delta.content or "" for c in expected if c.choices)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 8
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in chunks)  # usage was the gateway's to strip
    else:
        reply = client.chat.completions.create(**asked, extra_headers={"x-request-id": request_id})
        text = reply.choices[0].message.content or ""
        want = straight.chat.completions.create(**asked).choices[0].message.content or ""
        assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert text and text == want
    record = record_of(wire_gw, request_id)
    assert record["status"] == "ok"
    assert record["stream"] is stream
    assert record["completion_tokens"] == 8
    assert 0 < record["upstream_s"] < record["e2e_s"]
    assert record["queue_s"] <= record["upstream_s"]
    assert 0 < record["overhead_s"] <= record["upstream_s"]


# --- 2. Expect: 100-continue -------------------------------------------------------


def test_expect_100_continue_gets_its_own_answer_and_never_leaks_it(
    module_tmp: Path, fast_sim: Proc
) -> None:
    """The client asks for ``100 Continue`` before sending its body. The gateway must
    say it (uvicorn does, when the handler reads the body) and then answer with the
    backend's 200 and this request's body. It must not pass ``expect`` upstream: the
    backend would answer 100 then 200, and before the fix the upstream client took the
    100 for the answer (a final 100 with no body reached the client) and left the real
    200 on the pooled connection, where the next request, another client's, read it as
    its own. So each 100-continue request is followed, on another keep-alive connection,
    by a normal request of another size and seed, and every body must be the one the
    simulator gives for that very request. (Its own gateway: a leak would poison the
    shared one's pooled connections for the other tests.)"""
    gw = start_gateway(module_tmp, {"backends": [backend("s", fast_sim.url)]})
    other = RawConnection(gw)
    try:
        for i in range(20):
            body = chat_body(max_tokens=3 + i % 4, seed=i)
            request_id = new_id("expect")
            head = post_bytes(CHAT, body, {"x-request-id": request_id, "expect": "100-continue"})
            conn = RawConnection(gw)  # a fresh client each time
            try:
                conn.send(head[: -len(body)])
                [interim] = conn.responses(1)
                assert interim["status"] == 100, interim  # the handler asked for the body
                conn.send(body)
                [response] = conn.responses(1)
            finally:
                conn.close()
            assert response["status"] == 200, response
            assert response["headers"]["x-request-id"] == request_id
            assert response["body"] == direct(fast_sim, body).content, f"round {i}"

            normal = chat_body(max_tokens=1 + i % 3, seed=100 + i)
            other_id = new_id("other")
            other.send(post_bytes(CHAT, normal, {"x-request-id": other_id}))
            [answer] = other.responses(1)
            assert answer["status"] == 200, answer
            assert answer["headers"]["x-request-id"] == other_id
            assert answer["body"] == direct(fast_sim, normal).content, f"leak in round {i}"
        assert idle(gw)
    finally:
        other.close()
        gw.proc.stop()


# --- 3. head and body in two writes -----------------------------------------------


def test_body_sent_after_the_handler_ran_is_proxied(wire_gw: Gateway, fast_sim: Proc) -> None:
    """A body whose bytes arrive after the handler already waits in ``receive`` must be
    proxied and recorded like any other. What orders the two writes is not a pause: the
    gateway runs ready tasks first in, first out, and the split request's handler was
    scheduled when its head was read, before /health (asked on another connection after
    the head was written) was even accepted; so once /health is answered, that handler
    has run and waits for the body."""
    request_id = new_id("split")
    body = chat_body(max_tokens=5, seed=3)
    whole = post_bytes(CHAT, body, {"x-request-id": request_id})
    conn = RawConnection(wire_gw)
    try:
        conn.send(whole[: -len(body)])
        assert httpx.get(wire_gw.url + "/health", timeout=5).status_code == 200
        conn.send(body)
        [response] = conn.responses(1)
    finally:
        conn.close()
    assert response["status"] == 200
    assert response["headers"]["x-request-id"] == request_id
    assert response["body"] == direct(fast_sim, body).content
    record = record_of(wire_gw, request_id)
    assert record["status"] == "ok"
    assert record["completion_tokens"] == 5
    assert 0 < record["upstream_s"] < record["e2e_s"]


# --- 4. no free permit: queued ----------------------------------------------------


def test_request_that_must_queue_waits_for_the_permit_and_is_answered(tmp_path: Path) -> None:
    """With one permit held by a long stream, a second request must wait in the queue
    (not be refused, dropped or admitted twice), be answered once the first ended, and
    leave nothing taken."""
    sim = start_sim(tmp_path, ttft_ms=5, itl_ms=10)
    gw = start_gateway(
        tmp_path,
        {
            "backends": [backend("s", sim.url, limit=STATIC_1)],
            "pools": {"short": {"max_queue_depth": 8, "max_queue_wait_s": 30}},
        },
    )
    outcomes: dict[str, Any] = {}
    long_id, queued_id = new_id("long"), new_id("queued")

    def long_stream() -> None:  # ~1.5 s of tokens, holding the only permit
        chunks = openai_client(gw.url).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=150,
            stream=True,
            extra_headers={"x-request-id": long_id},
        )
        outcomes["long"] = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)

    def queued() -> None:
        reply = openai_client(gw.url).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"x-request-id": queued_id}
        )
        outcomes["queued"] = reply.usage.completion_tokens if reply.usage else None

    try:
        first = threading.Thread(target=long_stream)
        first.start()
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        second = threading.Thread(target=queued)
        second.start()
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 1)
        assert first.is_alive()  # the permit is still held: the second really waits for it
        first.join(30)
        second.join(30)
        assert outcomes == {"long": 150, "queued": 3}
        waited = record_of(gw, queued_id)
        assert waited["status"] == "ok"
        assert waited["queue_s"] > 0.1  # it waited for the long stream, not for a turn
        assert waited["queue_s"] <= waited["upstream_s"] < waited["e2e_s"]
        # Its own time before the write leaves the queue wait out: a small part of it.
        assert 0 < waited["overhead_s"] < waited["upstream_s"] - 0.1
        assert record_of(gw, long_id)["status"] == "ok"
        ids = [r["request_id"] for r in records(gw)]
        assert ids.index(long_id) < ids.index(queued_id)  # answered once the first ended
        wait_until(lambda: idle(gw), timeout=5)
        state = gw.state()
        assert state["backends"][0]["in_flight"] == 0
        assert state["pools"]["short"] == {"queue_depth": 0, "leased": 0}
    finally:
        gw.proc.stop()
        sim.stop()


# --- 5. refusals: the right error, once --------------------------------------------

API_KEY = "k-wire"
ADMIN = "adm-wire"


def test_refusals_are_answered_once_on_a_keep_alive_connection(
    tmp_path: Path, fast_sim: Proc
) -> None:
    """Each refusal must be one OpenAI error (a second response, or none, would show up
    as the next request's answer on the same connection), and a no_backend refusal must
    be counted exactly once."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: never healthy
    gw = start_gateway(
        tmp_path,
        {
            "backends": [backend("s", fast_sim.url), backend("dead", dead, models=["dead-model"])],
            "auth": {"api_keys": [API_KEY], "admin_token": ADMIN},
        },
    )
    auth = {"authorization": f"Bearer {API_KEY}"}
    health = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    conn = RawConnection(gw)

    def refused(body: bytes, headers: dict[str, str]) -> dict[str, Any]:
        """The one response to ``body``: the next one on the connection must be /health's."""
        request_id = new_id("refused")
        conn.send(post_bytes(CHAT, body, {"x-request-id": request_id, **headers}))
        [response] = conn.responses(1)
        conn.send(health)
        [after] = conn.responses(1)
        assert (after["status"], json.loads(after["body"])) == (200, {"status": "ok"})
        assert response["headers"]["x-request-id"] == request_id
        error = json.loads(response["body"])["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"]
        return {"status": response["status"], **error}

    try:
        wait_until(lambda: gw.state(ADMIN)["backends"][0]["healthy"])
        bad_key = refused(chat_body(), {"authorization": "Bearer wrong"})
        assert (bad_key["status"], bad_key["code"]) == (401, "invalid_api_key")
        bad_json = refused(b'{"model": ', auth)
        assert (bad_json["status"], bad_json["code"]) == (400, "invalid_json")
        missing = refused(json.dumps({"model": MODEL}).encode(), auth)
        assert (missing["status"], missing["param"]) == (400, "messages")
        unknown = refused(chat_body(model="no-such-model"), auth)
        assert (unknown["status"], unknown["code"]) == (404, "model_not_found")
        for _ in range(3):
            before = rejected(gw, "no_backend", ADMIN)
            down = refused(chat_body(model="dead-model"), auth)
            assert (down["status"], down["code"]) == (503, "no_healthy_backend")
            assert rejected(gw, "no_backend", ADMIN) == before + 1
        # Nothing the refused requests touched is left taken, and the next one is fine.
        assert idle(gw, ADMIN)
        assert requests_total(gw, ADMIN) == 0  # none of them reached a backend
        reply = openai_client(gw.url, API_KEY).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "ok-1"}
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 2
        assert record_of(gw, "ok-1", ADMIN)["status"] == "ok"
    finally:
        conn.close()
        gw.proc.stop()


# --- 6. pipelining ----------------------------------------------------------------


def test_two_requests_in_one_write_are_both_answered_in_order(
    wire_gw: Gateway, fast_sim: Proc
) -> None:
    """One read holding two requests (a stream, then a whole answer): neither may be
    lost, swapped or answered with the other's body."""
    first = chat_body(max_tokens=6, seed=21, stream=True)
    second = chat_body(max_tokens=3, seed=22)
    ids = [new_id("pipe1"), new_id("pipe2")]
    conn = RawConnection(wire_gw)
    try:
        conn.send(
            post_bytes(CHAT, first, {"x-request-id": ids[0]})
            + post_bytes(CHAT, second, {"x-request-id": ids[1]})
        )
        responses = conn.responses(2)
    finally:
        conn.close()
    for response, body, request_id in zip(responses, (first, second), ids, strict=True):
        straight = direct(fast_sim, body)
        assert response["status"] == straight.status_code == 200
        assert response["headers"]["x-request-id"] == request_id
        assert response["body"] == straight.content
    assert responses[0]["headers"]["content-type"].startswith("text/event-stream")
    assert [record_of(wire_gw, i)["status"] for i in ids] == ["ok", "ok"]


# --- 7. clients that leave at once ------------------------------------------------


def _prompt_size(sim: Proc) -> int:
    reply = direct(sim, chat_body(max_tokens=1))
    return int(reply.json()["usage"]["prompt_tokens"])


def _hang_up(
    gw: Gateway, request_id: str, reset: bool, stream: bool = True, max_tokens: int = 5000
) -> socket.socket:
    """A socket that sent one request (by default ~10 s of tokens), to be closed."""
    sock = socket.create_connection(address(gw), timeout=10)
    if reset:  # close() then sends RST, not FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    body = chat_body(max_tokens=max_tokens, stream=stream)
    sock.sendall(post_bytes(CHAT, body, {"x-request-id": request_id}))
    return sock


def test_clients_hanging_up_right_after_sending_leave_nothing_behind(
    wire_gw: Gateway, fast_sim: Proc
) -> None:
    """50 clients close (FIN or RST) the moment their request is written. Nothing may be
    left taken, the backend's generations must be cancelled long before their 10 s,
    and the gateway must still serve. Each request that reached the backend is recorded
    once, as client_closed: the gateway may give a request up before or after writing it
    upstream, and the simulator may drop one whose connection closed before it read the
    body, so the exact number sent upstream is not observable here; what is: the records
    are no fewer than the generations the simulator started (exact, from its prompt-token
    counter), no more than the requests, and ``kneecap_requests_total`` rose by exactly
    the number of distinct ids recorded (nothing counted twice)."""
    prompt = _prompt_size(fast_sim)
    wait_until(lambda: idle(wire_gw) and sim_running(fast_sim) == 0, timeout=5)
    total_before = requests_total(wire_gw)
    started_before = sim_prompt_tokens(fast_sim)
    ids = [new_id(f"gone{i}") for i in range(50)]
    for i, request_id in enumerate(ids):
        _hang_up(wire_gw, request_id, reset=bool(i % 2)).close()
    wait_until(lambda: idle(wire_gw), timeout=8)
    # The upstream requests were given up too, long before they could have finished.
    wait_until(lambda: sim_running(fast_sim) == 0, timeout=5)

    rise = requests_total(wire_gw) - total_before
    started = (sim_prompt_tokens(fast_sim) - started_before) / prompt
    gone = [r for r in records(wire_gw) if r["request_id"] in set(ids)]
    assert started == int(started)
    assert started <= rise <= len(ids), (started, rise)
    assert rise == len(gone) == len({r["request_id"] for r in gone})
    assert {r["status"] for r in gone} <= {"client_closed"}
    assert requests_total(wire_gw, status="upstream_error") == 0

    request_id = new_id("after")
    reply = openai_client(wire_gw.url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-request-id": request_id}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert record_of(wire_gw, request_id)["status"] == "ok"
    assert idle(wire_gw)
    assert "Traceback" not in wire_gw.proc.output()


def test_every_request_that_reached_the_backend_is_recorded_exactly_once(
    wire_gw: Gateway, fast_sim: Proc
) -> None:
    """The exact form of the property above: each client hangs up once the simulator has
    started its generation (its prompt-token counter rose), so every one of them reached
    the backend, and ``kneecap_requests_total`` must rise by exactly their number, each
    recorded once as client_closed. Streamed ones leave while the gateway relays (the
    simulator sends a stream's head before it generates); non-streamed ones before the
    answer's head (the simulator sends a whole answer at its end, here after 1 s), which
    before the fix left no record at all."""
    prompt = _prompt_size(fast_sim)
    wait_until(lambda: idle(wire_gw) and sim_running(fast_sim) == 0, timeout=5)
    total_before = requests_total(wire_gw)
    ids = [new_id(f"left{i}") for i in range(10)]
    for i, request_id in enumerate(ids):
        before = sim_prompt_tokens(fast_sim)
        stream = i % 2 == 0
        reset = (i // 2) % 2 == 1
        sock = _hang_up(wire_gw, request_id, reset, stream, 5000 if stream else 500)
        try:
            wait_until(lambda b=before: sim_prompt_tokens(fast_sim) == b + prompt, timeout=5)
        finally:
            sock.close()
    wait_until(lambda: idle(wire_gw), timeout=8)
    wait_until(lambda: sim_running(fast_sim) == 0, timeout=5)
    assert requests_total(wire_gw) - total_before == len(ids)
    assert [record_of(wire_gw, i)["status"] for i in ids] == ["client_closed"] * len(ids)


# --- 8. a non-streamed client that leaves while the backend works ------------------


@pytest.fixture(scope="module")
def slow(module_tmp: Path) -> Iterator[tuple[Gateway, Proc]]:
    sim = start_sim(module_tmp, ttft_ms=5, itl_ms=20)
    gw = start_gateway(
        module_tmp,
        {"backends": [backend("slow", sim.url, limit=STATIC_1)], "health": {"interval_s": 0.2}},
    )
    try:
        yield gw, sim
    finally:
        gw.proc.stop()
        sim.stop()


def test_non_streamed_client_leaving_before_the_head_is_client_closed(
    slow: tuple[Gateway, Proc],
) -> None:
    """A long whole-answer generation (the simulator sends it only at its end) whose
    client closes its socket once tokens flow: the gateway is waiting for the response
    head. Recorded once as client_closed, no upstream_error, the backend still healthy,
    the permit back (before: no record and no metric at all)."""
    gw, sim = slow
    wait_until(lambda: idle(gw) and gw.state()["backends"][0]["healthy"], timeout=5)
    closed_before = requests_total(gw, status="client_closed")
    errors_before = requests_total(gw, status="upstream_error")
    generated = metric_sum(sim.url, "vllm:generation_tokens_total")
    request_id = new_id("left")
    conn = RawConnection(gw)
    try:
        conn.send(post_bytes(CHAT, chat_body(max_tokens=100), {"x-request-id": request_id}))
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1, timeout=5)
        wait_until(
            lambda: metric_sum(sim.url, "vllm:generation_tokens_total") >= generated + 5,
            timeout=5,
        )
    finally:
        conn.close()
    record = record_of(gw, request_id)
    assert record["status"] == "client_closed" and record["stream"] is False
    assert record["upstream_s"] is not None and record["upstream_s"] > 0
    assert requests_total(gw, status="client_closed") == closed_before + 1
    assert requests_total(gw, status="upstream_error") == errors_before
    wait_until(lambda: idle(gw), timeout=5)  # the permit came back
    wait_until(lambda: sim_running(sim) == 0, timeout=5)  # a whole answer ends on its own
    assert gw.state()["backends"][0]["healthy"]
    reply = openai_client(gw.url).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_non_streamed_client_leaving_mid_answer_is_not_the_backends_failure(
    tmp_path: Path,
) -> None:
    """The backend has sent the head and part of a whole answer when the client leaves:
    the gateway is reading the body. Recorded client_closed, not upstream_error (which
    fed the limit controller a backend failure before), and the permit comes back."""
    echo = start_echo(tmp_path)
    gw = start_gateway(tmp_path, {"backends": [echo_backend(echo.url)]})
    try:
        request_id = new_id("mid")
        conn = RawConnection(gw)
        try:
            conn.send(
                post_bytes(
                    CHAT, chat_body(model=ECHO_MODEL, echo_stall=True), {"x-request-id": request_id}
                )
            )
            stalled = lambda: httpx.get(echo.url + "/stalled", timeout=5).json()["stalled"]  # noqa: E731
            wait_until(lambda: stalled() == 1, timeout=5)
            # The head is in the gateway's socket before /stalled answered; a request the
            # gateway answers after that is read in the same or a later loop turn, so the
            # proxied request has taken the head and is reading the body when we leave.
            assert httpx.get(gw.url + "/health", timeout=5).status_code == 200
        finally:
            conn.close()
        wait_until(lambda: idle(gw), timeout=5)
        record = record_of(gw, request_id)
        assert record["status"] == "client_closed" and record["stream"] is False
        assert requests_total(gw, status="client_closed") == 1
        assert requests_total(gw, status="upstream_error") == 0
        assert gw.state()["backends"][0]["healthy"]
    finally:
        gw.proc.stop()
        echo.stop()


def test_a_request_head_over_64_kib_is_431_and_the_gateway_serves_on(wire_gw: Gateway) -> None:
    # httptools buffers a head of any size; the gateway held whatever a client sent.
    big = RawConnection(wire_gw)
    try:
        big.send(post_bytes(CHAT, chat_body(), {"x-padding": "p" * (70 * 1024)}))
        (answer,) = big.responses(1)
    finally:
        big.close()
    assert answer["status"] == 431
    assert json.loads(answer["body"])["error"]["code"] == "request_header_fields_too_large"
    normal = RawConnection(wire_gw)
    try:
        normal.send(post_bytes(CHAT, chat_body(), {"x-padding": "p" * (32 * 1024)}))
        (answer,) = normal.responses(1)
    finally:
        normal.close()
    assert answer["status"] == 200


def test_a_request_head_that_never_ends_is_cut_at_64_kib(wire_gw: Gateway) -> None:
    # Sent a piece at a time without its blank line, a head was held whatever it grew to.
    slow = RawConnection(wire_gw)
    try:
        slow.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        for n in range(20):  # 20 x 8 KiB of headers, never the blank line
            try:
                slow.send(b"x-pad-%d: %s\r\n" % (n, b"p" * 8192))
            except OSError:
                break  # the gateway answered and closed mid-way: what is tested
        (answer,) = slow.responses(1)
    finally:
        slow.close()
    assert answer["status"] == 431
