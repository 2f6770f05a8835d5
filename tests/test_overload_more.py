"""More of the gateway's own shortages, and how loudly it tells of them.

No local port left to reach a backend (EADDRNOTAVAIL) is the gateway's shortage, as out of
descriptors is: a 503 ``gateway_overloaded``, the backend not blamed. It is made real in a
network namespace of its own whose ephemeral port range is two ports wide. A name lookup
that finds no descriptor fails with the same errno as ``socket()`` and is told apart the
same way. And the warning for each such request is throttled: a burst is one line.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest

from gateway.overload import ThrottledWarning
from gateway.upstream import UpstreamTransport
from tests.port_range import in_own_network_namespace
from tests.procs import backend, start_gateway, wait_until
from tests.test_ops_robustness import counts, start_ops_backend
from tests.test_proxy_front_fixes import _RefusingTls, run_scenario

REPO = Path(__file__).resolve().parent.parent
OWN_LIMIT = "the gateway's own limit"


def _own_network_namespace() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    tried = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    return tried.returncode == 0


# Run inside a network namespace of its own: the gateway, its backends and this client
# are alone there, and the port range narrowed is theirs only.
_NO_LOCAL_PORT_LEFT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import httpx
    from tests.port_range import no_local_port_to
    from tests.procs import start_gateway
    from tests.test_proxy_front_fixes import chat, warm_and_cold
    from tests.test_proxy_upstream_request import start_echo

    def main(tmp):
        warm, cold = start_echo(tmp), start_echo(tmp)
        gw = start_gateway(tmp, warm_and_cold(warm.url, cold.url))
        client = httpx.Client(base_url=gw.url, timeout=10)  # one keep-alive connection
        try:
            # The proxy path runs once on a backend of its own: the one under test has
            # no connection yet to reuse, and the client's to the gateway stays open.
            assert client.post("/v1/chat/completions", json=chat(model="warm")).is_success
            cold_address = ("127.0.0.1", int(cold.url.rsplit(":", 1)[1]))
            with no_local_port_to(cold_address) as held:  # every local port to cold taken
                response = client.post("/v1/chat/completions", json=chat())
                # A port to another address is still free: the gateway can be asked.
                cold_state = next(b for b in gw.state()["backends"] if b["name"] == "cold")
            after = client.post("/v1/chat/completions", json=chat())
            print(json.dumps({
                "held": held,
                "status": response.status_code,
                "error": response.json().get("error"),
                "retry_after": response.headers.get("retry-after"),
                "cold_healthy": cold_state["healthy"],
                "after": after.status_code,
                "output": gw.proc.output(),
            }))
        finally:
            client.close()
            gw.proc.stop()
            warm.stop()
            cold.stop()

    main(Path(sys.argv[1]))
    """
)


@pytest.mark.skipif(not _own_network_namespace(), reason="needs `unshare -n` and `ip`")
def test_no_local_port_left_is_the_gateways_503_not_the_backends_failure(tmp_path: Path) -> None:
    result, _ = run_scenario(
        in_own_network_namespace(_NO_LOCAL_PORT_LEFT, str(tmp_path)),
        timeout=120,
    )
    assert result["held"] >= 1  # the range was used up by the holders, not before them
    assert result["status"] == 503, result  # was 502: the backend blamed and ejected
    assert result["error"]["code"] == "gateway_overloaded"
    assert "Cannot assign requested address" in result["error"]["message"]
    assert result["retry_after"] == "1"
    assert result["cold_healthy"] is True
    assert result["after"] == 200  # ports back, the same backend answers at once
    assert OWN_LIMIT in result["output"] and "ip_local_port_range" in result["output"]
    assert "is DOWN" not in result["output"]


def _own_mounts() -> bool:
    tried = subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True)
    return _own_network_namespace() and tried.returncode == 0


# Run in network and mount namespaces of their own: ``dual`` names ::1 and 127.0.0.1, and
# an https:// backend's connection is made by anyio, which tries both and gathers their
# failures in an ExceptionGroup (the plain-HTTP transport raises the first when alike).
_EVERY_ADDRESS_WITHOUT_A_PORT = textwrap.dedent(
    """
    import asyncio, json, socket
    from gateway.upstream import UpstreamTransport
    from tests.port_range import NARROW, RANGE, use_up

    def listen(family, host, port):
        sock = socket.socket(family)
        sock.bind((host, port))
        sock.listen(64)
        return sock

    async def main():
        both, v6_only = 5000, 5001  # a namespace of their own: both free
        listeners = [
            listen(socket.AF_INET, "127.0.0.1", both),
            listen(socket.AF_INET6, "::1", both),
            listen(socket.AF_INET6, "::1", v6_only),
        ]
        RANGE.write_text(NARROW)  # the namespace ends with the scenario: not restored
        held = []
        use_up(("127.0.0.1", both), held)
        use_up(("::1", both), held, socket.AF_INET6)
        use_up(("::1", v6_only), held, socket.AF_INET6)  # 127.0.0.1 refuses on this one
        results = {}
        for scheme in ("http", "https"):
            for port in (both, v6_only):
                transport = UpstreamTransport(max_connections=2)
                try:
                    await transport.post(f"{scheme}://dual:{port}/x", b"", b"{}", {})
                    results[f"{scheme}:{port}"] = "answered"
                except Exception as exc:
                    results[f"{scheme}:{port}"] = type(exc).__name__
        print(json.dumps(results))

    asyncio.run(main())
    """
)


@pytest.mark.skipif(not _own_mounts(), reason="needs `unshare -n -m`, `mount` and `ip`")
def test_a_name_of_two_addresses_neither_with_a_port_left_is_the_gateways_shortage(
    tmp_path: Path,
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 dual\n::1 dual\n")
    results, _ = run_scenario(
        [
            "unshare",
            "-n",
            "-m",
            "sh",
            "-c",
            'ip link set lo up && mount --bind "$2" /etc/hosts && exec "$0" -c "$1"',
            sys.executable,
            _EVERY_ADDRESS_WITHOUT_A_PORT,
            str(hosts),
        ],
        timeout=60,
    )
    assert results == {
        "http:5000": "GatewayOutOfResources",
        "https:5000": "GatewayOutOfResources",  # was ConnectError: the backend blamed
        "http:5001": "ConnectError",  # one address refused: the backend's answer
        "https:5001": "ConnectError",
    }


@pytest.mark.anyio
async def test_https_upstreams_take_no_local_port_as_the_gateways_shortage() -> None:
    """Unit level: httpx's own transport chains the ``OSError`` as it does for EMFILE,
    which the namespace test above cannot reach over plain HTTP."""
    transport = UpstreamTransport(max_connections=1, tls=_RefusingTls(errno.EADDRNOTAVAIL))
    with pytest.raises(httpx.ConnectError) as caught:
        await transport.post("https://backend.invalid/v1/completions", b"", b"{}", {})
    assert type(caught.value).__name__ == "GatewayOutOfResources"


# The lookup of a backend's name with no descriptor left: glibc fails with EAI_SYSTEM and
# errno EMFILE, which Python raises as OSError(EMFILE), before any socket is made.
_LOOKUP_WITHOUT_DESCRIPTORS = textwrap.dedent(
    """
    import asyncio, json, os, resource, sys, traceback
    from gateway.upstream import UpstreamTransport

    async def main(port):
        results = {}
        for url in (f"http://localhost:{port}/x", f"https://localhost:{port}/x"):
            transport = UpstreamTransport(max_connections=2)
            try:  # once with descriptors, for the lazy imports and the resolver's set-up
                await transport.post(url, b"", b"{}", {})
            except Exception:
                pass
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            lowest_free = os.dup(0)
            os.close(lowest_free)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            failure = None
            try:
                await transport.post(url, b"", b"{}", {})
            except Exception as exc:
                failure = exc
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            # Where the OSError under it came from (httpcore keeps it only as the context).
            cause = failure
            while cause is not None and getattr(cause, "errno", None) is None:
                cause = cause.__cause__ or cause.__context__
            frames = traceback.extract_tb(cause.__traceback__) if cause else []
            looked_up = any(frame.name == "getaddrinfo" for frame in frames)
            results[url] = [type(failure).__name__, looked_up]
        print(json.dumps(results))

    asyncio.run(main(sys.argv[1]))
    """
)


def test_a_name_lookup_without_descriptors_is_the_gateways_shortage() -> None:
    """Passed before this change too (the errno is EMFILE): kept as the proof that the
    lookup's failure is told apart, on both transports."""
    results, _ = run_scenario(
        [sys.executable, "-c", _LOOKUP_WITHOUT_DESCRIPTORS, "9"],
        timeout=30,
    )
    for url, (raised, in_lookup) in results.items():
        assert raised == "GatewayOutOfResources", url
        assert in_lookup, url  # the lookup failed, not a socket() after it


# -- the warning, once per burst -----------------------------------------------------


def test_a_burst_of_overloaded_requests_logs_one_warning(tmp_path: Path) -> None:
    ops = start_ops_backend(tmp_path, post_delay_s=5.0)  # the burst is over well before
    try:
        config = {
            "backends": [backend("ops", ops.url, limit={"kind": "static", "initial": 1, "max": 1})],
            "upstream": {"max_connections": 1, "connect_timeout_s": 0.5, "max_attempts": 1},
            "health": {"interval_s": 60},
        }
        gw = start_gateway(tmp_path, config)
        body = {"model": "Qwen/Qwen3-4B", "prompt": "x"}
        try:
            with httpx.Client(timeout=10) as holder:
                held = threading.Thread(
                    target=holder.post, args=(gw.url + "/tokenize",), kwargs={"json": body}
                )
                held.start()
                wait_until(lambda: counts(ops)["posts"] == 1)  # it holds the one connection

                async def burst() -> list[httpx.Response]:
                    async with httpx.AsyncClient(timeout=10) as client:
                        calls = [client.post(gw.url + "/tokenize", json=body) for _ in range(20)]
                        return await asyncio.gather(*calls)

                answers = asyncio.run(burst())
                held.join()
            codes = [a.json()["error"]["code"] for a in answers if a.status_code == 503]
            assert codes == ["gateway_overloaded"] * 20
            warnings = [line for line in gw.proc.output().splitlines() if OWN_LIMIT in line]
            assert len(warnings) == 1, warnings  # was one line per request
            assert "upstream.max_connections" in warnings[0]
        finally:
            gw.proc.stop()
    finally:
        ops.stop()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_throttled_warning_tells_the_count_it_kept_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    warning = ThrottledWarning(logging.getLogger("kneecap.test"), every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kneecap.test"):
        for i in range(10_000):
            clock.now = 100.0 + i * 0.0009  # ten thousand within 9 s
            warning.warning("request %s overloaded", i)
        assert [r.getMessage() for r in caplog.records] == ["request 0 overloaded"]
        clock.now = 110.0  # the interval is over: the next one is logged, with the count
        warning.warning("request %s overloaded", "late")
        clock.now = 119.9
        warning.warning("request %s overloaded", "kept back")
        clock.now = 130.0
        warning.warning("request %s overloaded", "last")
    assert [r.getMessage() for r in caplog.records] == [
        "request 0 overloaded",
        "request late overloaded (and 9999 more like it in the 10 s before, not logged)",
        "request last overloaded (and 1 more like it in the 20 s before, not logged)",
    ]
