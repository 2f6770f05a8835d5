"""Context-aware routing through real processes: pools, spill, context, affinity, tokens."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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
from tests.test_proxy_wire import metric_sum

STATIC_1 = {"kind": "static", "initial": 1, "min": 1, "max": 1}
STATIC_8 = {"kind": "static", "initial": 8, "min": 1, "max": 8}
CJK = "日本語の文章"  # 3 UTF-8 bytes a character: the simulator counts 4 bytes a token
LONG_STREAM = 20_000  # output tokens: a stream that lasts until its client leaves


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """Three fast fixed-latency backends: s0, s1 for short prompts, l0 for long ones."""
    tmp = tmp_path_factory.mktemp("routing")
    started: dict[str, Proc] = {}
    try:
        for name in ("s0", "s1", "l0"):
            started[name] = start_sim(tmp, ttft_ms=5, itl_ms=2)
        yield started
    finally:
        for proc in started.values():
            proc.stop()


def gateway(tmp_path: Path, backends: list[dict], **routing: Any) -> Gateway:
    config = {
        "backends": backends,
        "pools": {
            "short": {"max_prompt_tokens": 8192, "max_queue_depth": 8},
            "long": {"min_prompt_tokens": 8192, "max_queue_depth": 8},
        },
        "routing": routing,
    }
    return start_gateway(tmp_path, config)


def chat(text: str, max_tokens: int = 4, **extra: Any) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


def post(gw: Gateway, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def served_by(gw: Gateway, body: dict, headers: dict | None = None) -> str:
    response = post(gw, body, headers)
    assert response.status_code == 200, response.text
    return response.headers["x-kneecap-backend"]


class Hold:
    """A streamed request in the background, keeping its backend busy until :meth:`end`."""

    def __init__(self, gw: Gateway, body: dict, headers: dict | None = None) -> None:
        self.status: int | None = None
        self.backend: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gw, body, headers))
        self._thread.start()

    def _run(self, gw: Gateway, body: dict, headers: dict | None) -> None:
        body = {**body, "stream": True}
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as r:
            self.status, self.backend = r.status_code, r.headers.get("x-kneecap-backend")
            for _ in r.iter_lines():
                if self._stop.is_set():
                    break  # the client leaves: the gateway frees the permit and the tokens

    def end(self) -> tuple[int | None, str | None]:
        self._stop.set()
        self._thread.join(30)
        return self.status, self.backend


def backend_state(gw: Gateway, name: str) -> dict:
    return next(b for b in gw.state()["backends"] if b["name"] == name)


def three(trio: dict[str, Proc], **extra: Any) -> list[dict]:
    return [
        backend("s0", trio["s0"].url, "short", **extra),
        backend("s1", trio["s1"].url, "short", **extra),
        backend("l0", trio["l0"].url, "long", **extra),
    ]


def test_long_and_short_prompts_go_to_their_pools(tmp_path: Path, trio: dict[str, Proc]) -> None:
    backends = three(trio)
    backends[0]["max_model_len"] = 16384  # configured; the others are discovered
    gw = gateway(tmp_path, backends)
    try:
        short = {served_by(gw, chat("hello " * 200)) for _ in range(16)}
        assert short == {"s0", "s1"}  # both short replicas share the short prompts
        long = {served_by(gw, chat("abcd" * 12_000)) for _ in range(3)}  # ~12K tokens
        assert long == {"l0"}
        lengths = {b["name"]: b["max_model_len"] for b in gw.state()["backends"]}
        assert lengths == {"s0": 16384, "s1": 40960, "l0": 40960}
    finally:
        gw.proc.stop()


def reconfigure(gw: Gateway, **routing: Any) -> None:
    gw.write_config({**gw.config, "routing": routing})
    assert httpx.post(gw.url + "/admin/reload", timeout=10).status_code == 200


def test_short_prompts_spill_into_idle_long_headroom_only_when_on(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    backends = [
        backend("s0", trio["s0"].url, "short", limit=STATIC_1),
        backend("l0", trio["l0"].url, "long", limit=STATIC_8),
    ]
    gw = gateway(tmp_path, backends)  # spill.to_longer is on by default
    try:
        for spill in (True, False):
            reconfigure(gw, spill={"to_longer": spill})
            busy = Hold(gw, chat("x", max_tokens=LONG_STREAM))
            wait_until(lambda: backend_state(gw, "s0")["in_flight"] == 1)
            response = post(gw, chat("hello"), {"x-kneecap-max-queue-wait": "0.2"})
            if spill:
                assert response.status_code == 200
                assert response.headers["x-kneecap-backend"] == "l0"
            else:
                assert response.status_code == 429
                assert response.json()["error"]["code"] == "queue_timeout"
            assert busy.end() == (200, "s0")
            wait_until(lambda: backend_state(gw, "s0")["in_flight"] == 0)
    finally:
        gw.proc.stop()


def test_long_prompts_never_spill_into_the_short_pool_by_default(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    backends = [
        backend("s0", trio["s0"].url, "short", limit=STATIC_8),
        backend("l0", trio["l0"].url, "long", limit=STATIC_1),
    ]
    long_prompt = "abcd" * 10_000
    gw = gateway(tmp_path, backends)
    try:
        for to_shorter in (False, True):
            if to_shorter:
                reconfigure(gw, spill={"to_shorter": True})
            busy = Hold(gw, chat(long_prompt, max_tokens=LONG_STREAM))
            wait_until(lambda: backend_state(gw, "l0")["in_flight"] == 1)
            response = post(gw, chat(long_prompt), {"x-kneecap-max-queue-wait": "0.2"})
            if to_shorter:
                assert response.status_code == 200
                assert response.headers["x-kneecap-backend"] == "s0"
            else:
                assert response.status_code == 429  # waited for l0, never took the idle s0
                assert backend_state(gw, "s0")["in_flight"] == 0
            assert busy.end() == (200, "l0")
            wait_until(lambda: backend_state(gw, "l0")["in_flight"] == 0)
    finally:
        gw.proc.stop()


def prompt_tokens_total(sim: Proc) -> float:
    text = httpx.get(sim.url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:prompt_tokens_total"))
    return float(line.rsplit(" ", 1)[1])


def test_a_prompt_beyond_every_context_is_refused_at_once(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    gw = gateway(tmp_path, three(trio))
    try:
        before = [prompt_tokens_total(sim) for sim in trio.values()]
        # 1.32M tokens on the simulator, and at least 41,250 at 128 characters a token.
        response = post(gw, chat("abcd" * 1_320_000))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "messages"
        assert "40960" in error["message"]
        assert [prompt_tokens_total(sim) for sim in trio.values()] == before  # nothing sent
        # The prompt fits, but not with the output it asks for: the engine's to judge
        # (the simulator, like vLLM 0.32, caps the output at the context).
        response = post(gw, chat("abcd" * 38_000, max_tokens=8_000))
        assert response.status_code == 200
        assert response.headers["x-kneecap-backend"] == "l0"
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert served_by(gw, chat("abcd" * 30_000)) == "l0"  # what fits still runs
    finally:
        gw.proc.stop()


def test_a_session_returns_to_its_replica_until_it_is_saturated(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    backends = [
        backend("s0", trio["s0"].url, "short", limit=STATIC_1),
        backend("s1", trio["s1"].url, "short", limit=STATIC_1),
        backend("l0", trio["l0"].url, "long"),
    ]
    gw = gateway(tmp_path, backends, affinity={"enabled": True}, spill={"to_longer": False})
    try:
        for session in ("a", "b", "c", "d"):
            header = {"x-kneecap-session": session}
            assert len({served_by(gw, chat("hi"), header) for _ in range(4)}) == 1
        by_user = {served_by(gw, chat("hi", user="alice")) for _ in range(4)}
        assert len(by_user) == 1
        home = served_by(gw, chat("hi"), {"x-kneecap-session": "z"})
        other = "s1" if home == "s0" else "s0"
        # Saturate the session's replica: the conversation moves, and then stays moved.
        busy = Hold(gw, chat("x", max_tokens=LONG_STREAM), {"x-kneecap-session": "z"})
        wait_until(lambda: backend_state(gw, home)["in_flight"] == 1)
        assert served_by(gw, chat("hi"), {"x-kneecap-session": "z"}) == other
        assert busy.end() == (200, home)
        assert served_by(gw, chat("hi"), {"x-kneecap-session": "z"}) == other
        assert gw.state()["routing"]["sessions"] == 6
    finally:
        gw.proc.stop()


def test_without_affinity_sequential_requests_spread(tmp_path: Path, trio: dict[str, Proc]) -> None:
    gw = gateway(tmp_path, three(trio))
    try:
        header = {"x-kneecap-session": "a"}
        assert {served_by(gw, chat("hi"), header) for _ in range(20)} == {"s0", "s1"}
    finally:
        gw.proc.stop()


def test_a_long_request_waits_for_tokens_while_request_slots_are_free(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    budget = {"limit": STATIC_8, "max_tokens_in_flight": 23_000}
    gw = gateway(tmp_path, [backend("s0", trio["s0"].url, "short", **budget)])
    try:
        first = Hold(gw, chat("abcd" * 2000, max_tokens=LONG_STREAM))  # 2007 + 20000 tokens
        wait_until(lambda: backend_state(gw, "s0")["in_flight"] == 1)
        state = backend_state(gw, "s0")
        assert (state["tokens_in_flight"], state["token_limit"]) == (22_007, 23_000)
        second = Hold(gw, chat("abcd" * 1000, max_tokens=100))  # 1007 + 100 tokens
        wait_until(lambda: gw.state()["pools"]["short"]["queue_depth"] == 1)
        state = backend_state(gw, "s0")
        assert (state["in_flight"], state["limit"]) == (1, 8)  # seven request slots free
        assert first.end() == (200, "s0")  # its client leaves: permit and tokens go back
        assert second.end() == (200, "s0")
        wait_until(lambda: backend_state(gw, "s0")["in_flight"] == 0)
        assert backend_state(gw, "s0")["tokens_in_flight"] == 0
    finally:
        gw.proc.stop()


def test_the_estimate_calibrates_from_usage(tmp_path: Path, trio: dict[str, Proc]) -> None:
    """12,000 CJK characters are 9,000 tokens: at 4 chars a token they look like 3,000."""
    gw = gateway(tmp_path, three(trio))
    try:
        prompt = chat(CJK * 2000)
        assert served_by(gw, prompt) in {"s0", "s1"}  # the prior misroutes it...
        for size in (200, 400, 800):
            served_by(gw, chat(CJK * size))
        calibration = gw.state()["routing"]["calibration"][MODEL]
        assert calibration["chars_per_token"] == pytest.approx(4 / 3, rel=0.02)
        assert calibration["observations"] == 4
        assert served_by(gw, prompt) == "l0"  # ...usage corrects it
    finally:
        gw.proc.stop()


def test_the_backend_tokenizer_counts_exactly_from_the_first_request(
    tmp_path: Path, trio: dict[str, Proc]
) -> None:
    gw = gateway(tmp_path, three(trio), estimator={"mode": "backend"})
    try:
        assert served_by(gw, chat(CJK * 2000)) == "l0"
        assert served_by(gw, chat(CJK * 200)) in {"s0", "s1"}
    finally:
        gw.proc.stop()


def test_a_local_tokenizer_json_counts_exactly(tmp_path: Path, trio: dict[str, Proc]) -> None:
    """6,000 words of one token each: 36,000 characters would look like 9,000 tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    estimator = {"mode": "tokenizer", "tokenizers": {MODEL: str(path)}}
    gw = gateway(tmp_path, three(trio), estimator=estimator)
    try:
        assert served_by(gw, chat("hello " * 6_000)) in {"s0", "s1"}
        assert served_by(gw, chat("hello " * 9_000)) == "l0"
    finally:
        gw.proc.stop()


def test_a_refusal_for_want_of_a_backend_counts_in_the_pool_the_prompt_belongs_to(
    tmp_path: Path,
) -> None:
    # It was counted in the pool of the first backend serving the model, whatever the
    # prompt's length: a long prompt's refusal showed on the short pool's panel.
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    gw = gateway(
        tmp_path,
        [backend("short-0", nowhere[0], "short"), backend("long-0", nowhere[1], "long")],
    )
    try:
        refused = post(gw, chat("word " * 9000))  # ~11K tokens: the long pool's
        assert refused.status_code == 503
        assert metric_sum(gw.url, "kneecap_rejected_requests_total", pool="long") == 1
        assert metric_sum(gw.url, "kneecap_rejected_requests_total", pool="short") == 0
    finally:
        gw.proc.stop()
