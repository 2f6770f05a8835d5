"""What the backend receives, and what the gateway blames, in four corners: a second
``Connection`` line, the gateway's own descriptors running out, a UTF-16/32 body that
must be rewritten, and ``/tokenize``'s key and request id. End to end through an echo
backend, which answers with the request it got."""

from __future__ import annotations

import errno
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.proxy_request import ProxyRequest, prepare_stream
from gateway.upstream import UpstreamTransport
from tests.procs import Proc, backend, start_gateway, wait_until
from tests.test_ops_robustness import counts, start_ops_backend
from tests.test_proxy_upstream_request import MODEL, echo_backend, fields_of, start_echo

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[Proc]:
    proc = start_echo(tmp_path)
    try:
        yield proc
    finally:
        proc.stop()


def header_names(echoed: dict) -> list[str]:
    return [name for name, _ in fields_of(echoed)]


def header_values(echoed: dict, name: str) -> list[str]:
    return [value for n, value in fields_of(echoed) if n == name]


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hé 😀"}], **extra}


# -- 1. every Connection line names hop-by-hop headers --------------------------------


def raw_exchange(url: str, request: bytes) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_headers_named_in_a_second_connection_line_are_not_forwarded(
    tmp_path: Path, echo: Proc
) -> None:
    gw = start_gateway(tmp_path, {"backends": [echo_backend(echo.url)]})
    try:
        body = json.dumps(chat()).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: keep-alive\r\nconnection: x-hop-one, X-Hop-Two\r\n"
            b"connection: close\r\n"
            b"x-hop-one: 1\r\nx-hop-two: 2\r\nx-end-to-end: kept\r\n\r\n%s"
        ) % (len(body), body)
        head, _, payload = raw_exchange(gw.url, request).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        names = header_names(json.loads(payload))
        assert "x-hop-one" not in names
        assert "x-hop-two" not in names
        assert "x-end-to-end" in names  # only what a Connection line named is dropped
    finally:
        gw.proc.stop()


# -- 2. the gateway's own descriptors running out are not the backend's failure --------

_PROBE_WITHOUT_DESCRIPTORS = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys
    import httpx
    from backends.health import probe_all
    from backends.pool import BackendSet
    from backends.replica import Replica
    from gateway.settings import BackendConfig, HealthConfig
    from gateway.upstream import UpstreamTransport

    async def main(url):
        transport = UpstreamTransport(max_connections=4)
        client = httpx.AsyncClient(transport=transport)
        replica = Replica(config=BackendConfig(name="echo", url=url, models=("echo",)), url=url)
        replica.healthy = replica.probed = True
        # Once with nothing to probe, for its lazy imports: they open files too.
        await probe_all(client, BackendSet.of([]), HealthConfig(), lambda r: None)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest_free = os.dup(0)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none left
        try:
            try:
                await transport.post(url + "/v1/completions", b"", b"{}", {})
                post = "answered"
            except Exception as exc:
                post = type(exc).__name__
            await probe_all(client, BackendSet.of([replica]), HealthConfig(), lambda r: None)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print(json.dumps({"post": post, "healthy": replica.healthy}))

    asyncio.run(main(sys.argv[1]))
    """
)


def run_scenario(command: list[str], timeout: float) -> tuple[Any, str]:
    """Run ``command`` from the repository (a scenario in a process or namespace of its
    own): what it printed last, read as JSON, and its log."""
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_out_of_descriptors_is_the_gateways_error_and_no_probe_verdict(echo: Proc) -> None:
    result, log = run_scenario(
        [sys.executable, "-c", _PROBE_WITHOUT_DESCRIPTORS, echo.url],
        timeout=30,
    )
    assert result["post"] == "GatewayOutOfResources"  # an httpx.ConnectError still
    assert result["healthy"] is True  # the probe could not ask: no verdict, no DOWN
    assert "the gateway's own limit" in log


class _RefusingTls(httpx.AsyncBaseTransport):
    """httpx's own transport failing to connect, its ``OSError`` chained underneath."""

    def __init__(self, errno_: int) -> None:
        self.errno = errno_

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            raise OSError(self.errno, os.strerror(self.errno))
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc


@pytest.mark.anyio
async def test_https_upstreams_tell_the_gateways_shortage_from_the_backends_refusal() -> None:
    for code, local in ((errno.EMFILE, True), (errno.ENOBUFS, True), (errno.ECONNREFUSED, False)):
        transport = UpstreamTransport(max_connections=1, tls=_RefusingTls(code))
        with pytest.raises(httpx.ConnectError) as caught:
            await transport.post("https://backend.invalid/v1/completions", b"", b"{}", {})
        # By name: the class is the fix (before it, every refusal was a ConnectError).
        assert (type(caught.value).__name__ == "GatewayOutOfResources") is local, code


def _open_descriptors(pid: int) -> set[int]:
    return {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}


def warm_and_cold(warm_url: str, cold_url: str) -> dict[str, Any]:
    """Two echo backends: "warm" serves its own model (a connection to it stays open),
    "cold" the rest; one failure counted against a backend would eject it."""
    return {
        "backends": [
            echo_backend(warm_url, name="warm", models=["warm"]),
            echo_backend(cold_url, name="cold"),
        ],
        "health": {"failure_threshold": 1},
        "upstream": {"max_attempts": 2},
    }


def test_a_request_the_gateway_has_no_descriptor_for_is_a_503_not_a_backend_failure(
    tmp_path: Path,
) -> None:
    warm, cold = start_echo(tmp_path), start_echo(tmp_path)
    gw = start_gateway(tmp_path, warm_and_cold(warm.url, cold.url))
    pid = gw.proc.pid
    client = httpx.Client(base_url=gw.url, timeout=10)  # one keep-alive connection
    try:
        # The whole proxy path runs once (its lazy imports need descriptors too), on a
        # backend of its own: the one under test has no connection yet to reuse.
        warmup = client.post("/v1/chat/completions", json=chat(model="warm"))
        assert warmup.status_code == 200
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = _open_descriptors(pid)
        lowest_free = min(fd for fd in range(len(used) + 1) if fd not in used)
        # The client's connection is open already; the upstream one finds no descriptor.
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))
        try:
            response = client.post("/v1/chat/completions", json=chat())
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "gateway_overloaded"
        assert "Too many open files" in error["message"]
        assert response.headers["retry-after"] == "1"
        cold_state = next(b for b in gw.state()["backends"] if b["name"] == "cold")
        assert cold_state["healthy"] is True
        assert client.post("/v1/chat/completions", json=chat()).is_success
        wait_until(lambda: "the gateway's own limit" in gw.proc.output(), timeout=5)
        assert "is DOWN" not in gw.proc.output()
    finally:
        client.close()
        gw.proc.stop()
        warm.stop()
        cold.stop()


# -- 3. a UTF-16/UTF-32 body that must be rewritten is rewritten in UTF-8 ---------------


def test_a_streamed_body_in_utf16_or_utf32_reaches_the_backend_in_utf8(
    tmp_path: Path, echo: Proc
) -> None:
    gw = start_gateway(tmp_path, {"backends": [echo_backend(echo.url)]})
    try:
        for encoding in ("utf-16-be", "utf-16-le", "utf-32-be", "utf-32-le"):
            sent = chat(stream=True, max_tokens=3)
            response = httpx.post(
                gw.url + "/v1/chat/completions",
                content=json.dumps(sent, ensure_ascii=False).encode(encoding),
                headers={"content-type": "application/json"},
                timeout=10,
            )
            assert response.status_code == 200, (encoding, response.text)
            echoed = response.json()
            received = json.loads(echoed["body"])  # the echo decodes it as UTF-8
            assert received == {**sent, "stream_options": {"include_usage": True}}, encoding
            length = int(header_values(echoed, "content-length")[0])
            assert length == len(echoed["body"].encode()), encoding
    finally:
        gw.proc.stop()


def _streamed(body: bytes) -> ProxyRequest:
    return ProxyRequest(
        endpoint="/v1/chat/completions",
        payload=json.loads(body),
        body=body,
        headers={},
        raw_headers=[],
        request_id="r",
        started=0.0,
    )


def test_a_utf8_body_keeps_its_bytes_and_gets_the_key_spliced_on() -> None:
    body = b'{"model": "m",  "messages": [], "stream": true}  \n'
    request = _streamed(body)
    assert prepare_stream(request)
    assert request.body == body.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'


def test_a_utf16_body_with_a_lone_surrogate_is_reserialised_escaped() -> None:
    text = '{"model": "m", "prompt": "\ud800", "stream": true}'  # a raw lone surrogate
    request = _streamed(text.encode("utf-16-be", "surrogatepass"))
    assert prepare_stream(request)
    assert b"\\ud800" in request.body
    assert json.loads(request.body) == {
        "model": "m",
        "prompt": "\ud800",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# -- 4. /tokenize carries the client's key and request id, as the proxied paths do ------


def test_tokenize_forwards_the_client_key_and_request_id(tmp_path: Path, echo: Proc) -> None:
    config = {
        "backends": [echo_backend(echo.url)],
        "auth": {"api_keys": ["sk-client"], "forward_client_key": True},
    }
    gw = start_gateway(tmp_path, config)
    try:
        headers = {"authorization": "Bearer sk-client", "x-request-id": "rid-7"}
        response = httpx.post(
            gw.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=headers
        )
        assert response.status_code == 200, response.text
        echoed = response.json()
        assert echoed["request_line"].startswith("POST /tokenize ")
        assert header_values(echoed, "authorization") == ["Bearer sk-client"]
        assert header_values(echoed, "x-request-id") == ["rid-7"]
        assert response.headers["x-request-id"] == "rid-7"
        # Without one, the id the gateway makes is the one the backend and the client see.
        del headers["x-request-id"]
        response = httpx.post(
            gw.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=headers
        )
        made = response.headers["x-request-id"]
        assert header_values(response.json(), "x-request-id") == [made]
    finally:
        gw.proc.stop()


def test_tokenize_sends_the_backends_own_key_over_the_clients(tmp_path: Path, echo: Proc) -> None:
    config = {
        "backends": [{**echo_backend(echo.url), "api_key": "sk-backend"}],
        "auth": {"api_keys": ["sk-client"], "forward_client_key": True},
    }
    gw = start_gateway(tmp_path, config)
    try:
        response = httpx.post(
            gw.url + "/tokenize",
            json={"model": MODEL, "prompt": "hi"},
            headers={"authorization": "Bearer sk-client"},
        )
        assert response.status_code == 200, response.text
        assert header_values(response.json(), "authorization") == ["Bearer sk-backend"]
    finally:
        gw.proc.stop()


def test_a_full_upstream_pool_is_the_gateways_shortage_not_the_backends(tmp_path: Path) -> None:
    """/tokenize shares the traffic's connection pool: with it holding the one connection,
    an admitted request found none within the pool timeout, was answered 504 and counted
    against a healthy backend (ejected here, at a threshold of 1)."""
    ops = start_ops_backend(tmp_path, post_delay_s=3.0)
    try:
        config = {
            "backends": [backend("ops", ops.url, limit={"kind": "static", "initial": 1, "max": 1})],
            "upstream": {"max_connections": 1, "connect_timeout_s": 0.5, "max_attempts": 1},
            "health": {"interval_s": 60, "failure_threshold": 1},
        }
        gw = start_gateway(tmp_path, config)
        try:
            with httpx.Client(timeout=10) as holder, httpx.Client(timeout=10) as client:
                body = {"model": "Qwen/Qwen3-4B", "prompt": "x"}
                held = threading.Thread(
                    target=holder.post, args=(gw.url + "/tokenize",), kwargs={"json": body}
                )
                held.start()
                wait_until(lambda: counts(ops)["posts"] == 1)  # it holds the one connection
                answer = client.post(gw.url + "/v1/completions", json={**body, "max_tokens": 1})
                tokenized = client.post(gw.url + "/tokenize", json=body)  # shares the pool
                held.join()
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "gateway_overloaded"
            assert answer.headers["retry-after"] == "1"
            assert tokenized.status_code == 503, tokenized.text  # was 502 bad_gateway
            assert tokenized.json()["error"]["code"] == "gateway_overloaded"
            metrics = httpx.get(gw.url + "/metrics", timeout=5).text
            overloaded = (
                'kneecap_rejected_requests_total{pool="short",reason="gateway_overloaded"} 1.0'
            )
            assert overloaded in metrics  # an operator sees them counted, not only logged
            (state,) = gw.state()["backends"]
            assert state["healthy"] is True  # not ejected for the gateway's own limit
            assert "upstream.max_connections" in gw.proc.output()
        finally:
            gw.proc.stop()
    finally:
        ops.stop()


def test_the_estimators_count_on_a_backend_carries_the_requests_identity(
    tmp_path: Path, echo: Proc
) -> None:
    """With ``estimator.mode: backend``, the gateway's own /tokenize for a request went
    without its id or the forwarded client key: a vLLM behind --api-key answered it 401
    and every estimate fell back to characters."""
    config = {
        "backends": [echo_backend(echo.url)],
        "auth": {"api_keys": ["sk-client"], "forward_client_key": True},
        "routing": {"estimator": {"mode": "backend"}},
    }
    gw = start_gateway(tmp_path, config)
    try:
        headers = {"authorization": "Bearer sk-client", "x-request-id": "rid-9"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(gw.url + "/v1/chat/completions", json=chat, headers=headers)
        assert response.status_code == 200, response.text
        counted = httpx.get(echo.url + "/seen/tokenize", timeout=5).json()
        assert counted["request_line"].startswith("POST /tokenize ")
        assert header_values(counted, "authorization") == ["Bearer sk-client"]
        assert header_values(counted, "x-request-id") == ["rid-9"]
    finally:
        gw.proc.stop()
