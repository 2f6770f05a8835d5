"""Operating the gateway when things go wrong: broken config files, odd backends, shutdown.

Each test drives real ``kneecap serve`` processes over HTTP on 127.0.0.1 and checks
that one bad input stays one rejected input: the gateway keeps serving on what it
had, says what was wrong, leaks no secret, and stops only when told, and cleanly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    free_port,
    start_gateway,
    start_process,
    start_sim,
    wait_until,
)
from tests.test_cli import run_cli

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
RELOAD_ERRORS = 'kneecap_config_reloads_total{result="error"}'

# Files that are not configs for reasons YAML parsing and pydantic do not catch,
# with what the rejection must name.
UNUSABLE_FILES = {
    "non-string key": (b"1: 2\n", "1"),
    "not UTF-8": (b"# caf\xe9\nbackends: []\n", "UTF-8"),
}
unusable_files = pytest.mark.parametrize(
    ("content", "named"), list(UNUSABLE_FILES.values()), ids=list(UNUSABLE_FILES)
)
unusable_contents = pytest.mark.parametrize(
    "content", [content for content, _ in UNUSABLE_FILES.values()], ids=list(UNUSABLE_FILES)
)


def static_limit(n: int) -> dict:
    return {"kind": "static", "initial": n, "min": 1, "max": n}


def write_raw(gw: Gateway, content: bytes) -> None:
    """Replaces the config file atomically, so a watcher never reads half of it."""
    tmp = gw.config_path.with_suffix(".raw")
    tmp.write_bytes(content)
    tmp.replace(gw.config_path)


def reload_errors(gw: Gateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith(RELOAD_ERRORS))
    return float(line.rsplit(" ", 1)[1])


def error_message(response: httpx.Response) -> str:
    body = response.json()
    # An OpenAI-style body nests the message; the admin endpoint's own shape does not.
    return body["error"]["message"] if "error" in body else body["message"]


def chat(gw: Gateway, headers: dict | None = None, timeout: float = 10) -> httpx.Response:
    url = gw.url + "/v1/chat/completions"
    return httpx.post(url, json=CHAT, headers=headers, timeout=timeout)


def start_ops_backend(
    tmp: Path,
    models_json: str | None = None,
    post_status: int = 200,
    port: int | None = None,
    post_delay_s: float = 0.0,
) -> Proc:
    port = port or free_port()
    args = ["--port", str(port)] + (["--models-json", models_json] if models_json else [])
    args += ["--post-status", str(post_status), "--post-delay", str(post_delay_s)]
    url = f"http://127.0.0.1:{port}"
    return start_process(args, url, "/health", tmp / f"ops-{port}.log", module="tests.ops_backend")


def counts(ops: Proc) -> dict:
    return httpx.get(ops.url + "/counts", timeout=5).json()


# -- 1. config files that fail outside validation -----------------------------


@unusable_files
def test_admin_reload_rejects_an_unusable_file_and_keeps_serving(
    tmp_path: Path, sims: list[Proc], content: bytes, named: str
) -> None:
    gw = start_gateway(tmp_path, {"backends": [backend("a", sims[0].url)]})
    try:
        errors_before = reload_errors(gw)
        write_raw(gw, content)
        response = httpx.post(gw.url + "/admin/reload", timeout=5)
        assert response.status_code == 400, response.text
        assert named in error_message(response)
        assert chat(gw).status_code == 200  # the old config still serves
        assert [b["name"] for b in gw.state()["backends"]] == ["a"]
        assert reload_errors(gw) == errors_before + 1
    finally:
        gw.proc.stop()


@unusable_files
def test_check_config_rejects_an_unusable_file_without_a_traceback(
    tmp_path: Path, content: bytes, named: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert named in result.stderr
    # A reason, not a dump: the header line and the one-line reason at most.
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


@unusable_contents
def test_watched_unusable_file_is_survived_and_the_fix_applies(
    tmp_path: Path, sims: list[Proc], content: bytes
) -> None:
    config = {
        "backends": [backend("a", sims[0].url, limit=static_limit(2))],
        "watch_config": True,
    }
    gw = start_gateway(tmp_path, config)
    try:
        errors_before = reload_errors(gw)
        write_raw(gw, content)
        wait_until(lambda: reload_errors(gw) > errors_before, timeout=6)
        answer = chat(gw)
        assert answer.status_code == 200, answer.text
        gw.write_config(
            {**gw.config, "backends": [backend("a", sims[0].url, limit=static_limit(3))]}
        )
        wait_until(lambda: gw.state()["backends"][0]["limit"] == 3, timeout=10)
        assert chat(gw).status_code == 200
    finally:
        gw.proc.stop()


# -- 2. a backend whose model listing is not an object --------------------------


@pytest.mark.parametrize("added", ["at startup", "by reload"])
@pytest.mark.parametrize("listing", ['[{"id": "m"}]', '"models"'], ids=["array", "string"])
def test_backend_with_an_odd_model_listing_is_only_unhealthy(
    tmp_path: Path, sims: list[Proc], listing: str, added: str
) -> None:
    odd = start_ops_backend(tmp_path, listing)
    good = backend("good", sims[0].url)
    odd_backend = {"name": "odd", "url": odd.url}  # no models: discovered from /v1/models
    config = {"backends": [good, odd_backend], "health": {"interval_s": 0.2}}
    try:
        if added == "at startup":
            gw = start_gateway(tmp_path, config)
        else:
            gw = start_gateway(tmp_path, {**config, "backends": [good]})
            gw.write_config({**gw.config, "backends": [good, odd_backend]})
            assert httpx.post(gw.url + "/admin/reload", timeout=5).status_code == 200
        try:
            # Requests keep succeeding while the prober reads the odd listing round after
            # round; a prober that died on it would stop asking.
            probed = counts(odd)["model_listings"]
            deadline = time.monotonic() + 10
            while counts(odd)["model_listings"] < probed + 4:
                assert time.monotonic() < deadline, "the prober stopped probing"
                answer = chat(gw)
                assert answer.status_code == 200, answer.text
            healthy = {b["name"]: b["healthy"] for b in gw.state()["backends"]}
            assert healthy == {"good": True, "odd": False}
        finally:
            gw.proc.stop()
    finally:
        odd.stop()


# -- 3. a rejected SIGHUP reload must not print secrets ------------------------


@unusable_contents
def test_sighup_with_an_unusable_file_leaks_no_secret(
    tmp_path: Path, sims: list[Proc], content: bytes
) -> None:
    client_key, admin_token = "sk-client-key-do-not-log", "admin-token-do-not-log"
    config = {
        "backends": [backend("a", sims[0].url)],
        "auth": {"api_keys": [client_key], "admin_token": admin_token},
    }
    gw = start_gateway(tmp_path, config)
    try:
        errors_before = reload_errors(gw)
        write_raw(gw, content)
        os.kill(gw.proc.pid, signal.SIGHUP)
        wait_until(lambda: reload_errors(gw) == errors_before + 1, timeout=6)
        answer = chat(gw, headers={"authorization": f"Bearer {client_key}"})
        assert answer.status_code == 200, answer.text
    finally:
        gw.proc.stop()  # the whole log is on disk once the process has ended
    output = gw.proc.output()
    assert "kneecap gateway on" in output  # the capture works: the banner is there
    assert client_key not in output
    assert admin_token not in output


# -- 4. shutdown drains, up to listen.drain_timeout_s ---------------------------


@pytest.fixture(scope="module")
def slow_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    sim = start_sim(tmp_path_factory.mktemp("slow"), ttft_ms=5, itl_ms=20)
    try:
        yield sim
    finally:
        sim.stop()


def is_token(line: str) -> bool:
    return '"content":"' in line and '"content":""' not in line


def test_sigterm_lets_an_in_flight_stream_finish_within_the_drain_timeout(
    tmp_path: Path, slow_sim: Proc
) -> None:
    gw = start_gateway(
        tmp_path,
        {"backends": [backend("s", slow_sim.url)]},
        env={"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": "8"},
    )
    lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:  # 150 tokens at 20 ms: about 3 s
        body = {**CHAT, "stream": True, "max_tokens": 150}
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if is_token(line):
                    streaming.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert streaming.wait(10), "the stream never started"
        gw.proc.process.send_signal(signal.SIGTERM)
        client.join(20)
        assert not client.is_alive()
        assert sum(1 for line in lines if is_token(line)) == 150
        assert [line for line in lines if line][-1] == "data: [DONE]"
        assert gw.proc.process.wait(10) == 0
    finally:
        gw.proc.stop()
        client.join(5)


def test_drain_timeout_answers_queued_requests_503_and_exits(
    tmp_path: Path, slow_sim: Proc
) -> None:
    config = {
        "backends": [backend("s", slow_sim.url, limit=static_limit(1))],
        "pools": {"short": {"max_queue_depth": 8, "max_queue_wait_s": 30}},
    }
    gw = start_gateway(tmp_path, config, env={"KNEECAP_LISTEN__DRAIN_TIMEOUT_S": "1"})
    queued: list[httpx.Response] = []

    def long_stream() -> None:  # 1000 tokens at 20 ms: 20 s, far past the drain timeout
        body = {**CHAT, "stream": True, "max_tokens": 1000}
        try:
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # cut at the deadline: how it ends is not what this test checks

    def queued_request() -> None:
        queued.append(chat(gw, timeout=30))

    clients = [threading.Thread(target=long_stream), threading.Thread(target=queued_request)]
    try:
        clients[0].start()
        wait_until(lambda: gw.state()["backends"][0]["in_flight"] == 1)
        clients[1].start()
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 1)
        gw.proc.process.send_signal(signal.SIGTERM)
        clients[1].join(15)
        assert queued, "the queued request got no answer"
        assert queued[0].status_code == 503, queued[0].text
        assert queued[0].json()["error"]["code"] == "shutting_down"
        # Deadline 1 s plus a few for the lifespan to close: long before the 20 s stream ends.
        wait_until(lambda: gw.proc.process.poll() is not None, timeout=6)
    finally:
        gw.proc.stop()
        for client in clients:
            client.join(10)


# -- 5. /tokenize obeys max_body_bytes --------------------------------------------


def test_tokenize_body_over_the_limit_is_413_and_not_forwarded(tmp_path: Path) -> None:
    ops = start_ops_backend(tmp_path)
    try:
        gw = start_gateway(tmp_path, {"backends": [backend("o", ops.url)], "max_body_bytes": 1000})
        try:
            big = {"model": MODEL, "prompt": "y" * 200_000}
            proxied = httpx.post(gw.url + "/v1/completions", json=big, timeout=10)
            tokenized = httpx.post(gw.url + "/tokenize", json=big, timeout=10)
            assert proxied.status_code == 413  # what the proxied endpoints answer
            assert tokenized.status_code == 413, tokenized.text[:200]
            assert tokenized.json()["error"]["code"] == proxied.json()["error"]["code"]
            assert tokenized.json()["error"]["type"] == proxied.json()["error"]["type"]
            assert counts(ops)["posts"] == 0
            small = httpx.post(
                gw.url + "/tokenize", json={"model": MODEL, "prompt": "y"}, timeout=10
            )
            assert small.status_code == 200
            assert counts(ops)["posts"] == 1  # the count sees what is forwarded
        finally:
            gw.proc.stop()
    finally:
        ops.stop()


# -- 6. a queue-wait ceiling below the default wait is not a config ----------------

CEILING_BELOW_WAIT = {"pools": {"short": {"max_queue_wait_s": 3, "max_queue_wait_ceiling_s": 1}}}


def test_check_config_rejects_a_queue_wait_ceiling_below_the_wait(tmp_path: Path) -> None:
    path = tmp_path / "ceiling.yaml"
    path.write_text(yaml.safe_dump(CEILING_BELOW_WAIT))
    result = run_cli("check-config", str(path))
    assert result.returncode == 1, result.stdout
    assert "max_queue_wait_ceiling_s" in result.stderr
    assert "max_queue_wait_s" in result.stderr


def test_reload_rejects_a_queue_wait_ceiling_below_the_wait(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # reload validation needs no live backend
    gw = start_gateway(tmp_path, {"backends": [backend("a", nowhere)]})
    try:
        gw.write_config({**gw.config, **CEILING_BELOW_WAIT})
        response = httpx.post(gw.url + "/admin/reload", timeout=5)
        assert response.status_code == 400, response.text
        assert "max_queue_wait_ceiling_s" in error_message(response)
    finally:
        gw.proc.stop()


# -- 7. a pool's prompt range that holds nothing is not a config ----------------------


@pytest.mark.parametrize("low, high", [(8192, 4096), (8192, 8192)])
def test_check_config_rejects_an_empty_prompt_range(tmp_path: Path, low: int, high: int) -> None:
    path = tmp_path / "range.yaml"
    pools = {"long": {"min_prompt_tokens": low, "max_prompt_tokens": high}}
    path.write_text(yaml.safe_dump({"pools": pools}))
    result = run_cli("check-config", str(path))
    assert result.returncode == 1, result.stdout
    assert "max_prompt_tokens" in result.stderr
    assert "min_prompt_tokens" in result.stderr
