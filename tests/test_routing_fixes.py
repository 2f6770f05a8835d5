"""What a request costs and where it may go, through a real gateway and real backends.

* The token budget counts every sequence the engine runs: ``n`` (or ``best_of``) of
  each prompt, one per prompt of a batch; an embedding counts its input only.
* On a replica, a request holds at most its sequences times the context length: the
  engine stops each there, so that is what its claim holds and what admission checks.
* A prompt of token ids is counted, not estimated: refused as soon as it exceeds.
* The preference for a context that holds prompt + max_tokens uses the estimate itself,
  not the 10 % margin only refusals allow.
* An embedding needs no room for output: an input of exactly the context is forwarded.
* A backend a reload adds without ``models`` is waited for, as one with ``models`` is.

Requests are held on :mod:`tests.raw_sse_backend` until the test pokes it, so the counts
are read while the request is admitted, and probes answer when the test says.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import (
    MODEL,
    Gateway,
    Proc,
    backend,
    served,
    start_gateway,
    start_raw_sse,
    start_sim,
    wait_until,
)

QUIET_HEALTH = {"interval_s": 60}  # the startup round only, unless a reload wakes it
STATIC_8 = {"kind": "static", "initial": 8, "min": 1, "max": 8}
CONTEXT = 4096
IDS_100 = list(range(1, 101))


def answer(body: dict[str, Any]) -> str:
    text = json.dumps(body)
    return (
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        f"content-length: {len(text)}\r\n\r\n{text}"
    )


COMPLETION = {
    "object": "text_completion",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
}


def held(body: dict[str, Any]) -> dict[str, Any]:
    """The request, answered by the raw backend only once the test pokes it."""
    head, rest = answer(COMPLETION).split("\r\n\r\n", 1)
    script = [["send", head + "\r\n\r\n"], ["await_poke"], ["send", rest]]
    return {**body, "raw_script": script}


def backend_state(gw: Gateway, name: str) -> dict[str, Any]:
    return next(b for b in gw.state()["backends"] if b["name"] == name)


def poke(raw: Proc) -> None:
    assert httpx.get(raw.url + "/poke", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path_factory.mktemp("raw")))


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory, raw: Proc) -> Iterator[Gateway]:
    """A gateway with one backend of context 4096 and no token budget to wait for."""
    tmp = tmp_path_factory.mktemp("counted")
    config = {
        "backends": [backend("r", raw.url, max_model_len=CONTEXT, limit=STATIC_8)],
        "health": QUIET_HEALTH,
    }
    gw = start_gateway(tmp, config)
    try:
        yield gw
    finally:
        gw.proc.stop()


def tokens_held(gw: Gateway, raw: Proc, path: str, body: dict[str, Any]) -> int:
    """The tokens the request holds on its backend while admitted."""
    wait_until(lambda: backend_state(gw, "r")["in_flight"] == 0)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, gw.url + path, json=held(body), timeout=30)
        wait_until(lambda: sent.done() or backend_state(gw, "r")["in_flight"] == 1)
        tokens = backend_state(gw, "r")["tokens_in_flight"]
        if not sent.done():
            poke(raw)
        response = sent.result(30)
    assert response.status_code == 200, response.text
    return int(tokens)


def completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **extra}


@pytest.mark.parametrize(
    ("path", "body", "tokens"),
    [
        # n sequences of one prompt: the prompt once (prefix caching), n outputs.
        ("/v1/completions", completion(IDS_100, n=8, max_tokens=1000), 100 + 8 * 1000),
        ("/v1/completions", completion(IDS_100, best_of=8, max_tokens=1000), 100 + 8 * 1000),
        ("/v1/completions", completion([IDS_100] * 4, max_tokens=1000), 4 * (100 + 1000)),
        ("/v1/completions", completion([IDS_100] * 2, n=3, max_tokens=10), 200 + 6 * 10),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "abcd" * 100}],  # 100 + 4 + 3
                "n": 8,
                "max_completion_tokens": 1000,
            },
            107 + 8 * 1000,
        ),
        # Each sequence stops at the context: at most 4096 tokens each.
        ("/v1/completions", completion(IDS_100, max_tokens=40_000), CONTEXT),
        ("/v1/completions", completion(IDS_100, n=2, max_tokens=40_000), 2 * CONTEXT),
        # An embedding has no output to count.
        ("/v1/embeddings", {"model": MODEL, "input": IDS_100}, 100),
        ("/v1/embeddings", {"model": MODEL, "input": [IDS_100] * 3}, 300),
    ],
    ids=[
        "n",
        "best_of",
        "four_prompts",
        "two_prompts_n3",
        "chat_n",
        "capped",
        "capped_n2",
        "embedding",
        "embeddings",
    ],
)
def test_the_budget_counts_every_sequence_and_at_most_its_context(
    counted: Gateway, raw: Proc, path: str, body: dict[str, Any], tokens: int
) -> None:
    assert tokens_held(counted, raw, path, body) == tokens


def test_requests_capped_at_the_context_fit_the_budget_together(tmp_path: Path, raw: Proc) -> None:
    """Two 100 + 40,000-token requests on a 4,096 context and a budget of 10,000 tokens:
    each holds at most 4,096, so both run (before: the second waited for the first)."""
    config = {
        "backends": [
            backend(
                "r", raw.url, max_model_len=CONTEXT, max_tokens_in_flight=10_000, limit=STATIC_8
            )
        ],
        "health": QUIET_HEALTH,
    }
    gw = start_gateway(tmp_path, config)
    body = held(completion(IDS_100, max_tokens=40_000))
    sent: list[Future[httpx.Response]] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                sent.append(pool.submit(httpx.post, gw.url + "/v1/completions", json=body))
            wait_until(
                lambda: (
                    backend_state(gw, "r")["in_flight"] == 2
                    or gw.state()["pools"]["short"]["queue_depth"] == 1
                )
            )
            admitted = backend_state(gw, "r")
            for _ in range(admitted["in_flight"]):
                poke(raw)
            if admitted["in_flight"] < 2:  # the second, admitted once the first ended
                wait_until(lambda: backend_state(gw, "r")["in_flight"] == 1)
                poke(raw)
            statuses = [f.result(30).status_code for f in sent]
    finally:
        gw.proc.stop()
    assert (admitted["in_flight"], admitted["tokens_in_flight"]) == (2, 2 * CONTEXT)
    assert statuses == [200, 200]


# --- exact counts and the preference for a context that holds the output ------------------


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Proc]]:
    """Two fast simulators (context 40,960): smaller only by what the gateway is told."""
    tmp = tmp_path_factory.mktemp("sims")
    started: list[Proc] = []
    try:
        for _ in range(2):
            started.append(start_sim(tmp, ttft_ms=2, itl_ms=0.2))
        yield started
    finally:
        for proc in started:
            proc.stop()


def short_and_mid(tmp_path: Path, sims: list[Proc], **routing: Any) -> Gateway:
    config = {
        "backends": [
            backend("s0", sims[0].url, "short", max_model_len=512),
            backend("m0", sims[1].url, "mid", max_model_len=1000),
        ],
        "pools": {"short": {"max_prompt_tokens": 100}, "mid": {"min_prompt_tokens": 100}},
        "routing": routing,
    }
    return start_gateway(tmp_path, config)


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=30)


def test_a_prompt_of_token_ids_is_refused_as_soon_as_it_exceeds(
    tmp_path: Path, sims: list[Proc]
) -> None:
    """1,000 ids on a largest context of 1,000 leave no room for a token: refused by the
    gateway (before: taken for an estimate, forwarded unless 10 % over)."""
    gw = short_and_mid(tmp_path, sims)
    try:
        refused = post(gw, "/v1/completions", completion(list(range(1, 1001)), max_tokens=1))
        fits = post(gw, "/v1/completions", completion(list(range(1, 1000)), max_tokens=1))
    finally:
        gw.proc.stop()
    assert refused.status_code == 400, refused.text
    assert "x-kneecap-backend" not in refused.headers  # the gateway's own refusal
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "you requested 1000 tokens in the prompt" in error["message"]  # not "about"
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-kneecap-backend"] == "m0"


@pytest.mark.parametrize(
    "prompt", [list(range(1, 96)), "abcd" * 95], ids=["token_ids", "text_estimate"]
)
def test_the_preferred_context_holds_the_prompt_as_estimated_and_the_output(
    tmp_path: Path, sims: list[Proc], prompt: Any
) -> None:
    """95 prompt tokens + 420 = 515 > 512: m0 (1,000) holds it, s0 does not. Before, the
    estimate less 10 % (85 + 420 = 505) made s0 look as if it held it."""
    gw = short_and_mid(tmp_path, sims)
    try:
        response = post(gw, "/v1/completions", completion(prompt, max_tokens=420))
        fits_short = post(gw, "/v1/completions", completion(prompt, max_tokens=417))
    finally:
        gw.proc.stop()
    assert response.status_code == 200, response.text
    assert response.headers["x-kneecap-backend"] == "m0"
    assert fits_short.headers["x-kneecap-backend"] == "s0"  # 95 + 417 = 512: its own pool


def test_an_embedding_input_as_long_as_the_context_is_forwarded(
    tmp_path: Path, sims: list[Proc]
) -> None:
    """vLLM refuses an embedding input only over max_model_len: no output token needed."""
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    gw = short_and_mid(
        tmp_path, sims, estimator={"mode": "tokenizer", "tokenizers": {MODEL: str(path)}}
    )
    try:
        whole = post(gw, "/v1/embeddings", {"model": MODEL, "input": "a " * 1000})
        over = post(gw, "/v1/embeddings", {"model": MODEL, "input": "a " * 1001})
        prompt = post(gw, "/v1/completions", completion("a " * 1000, max_tokens=1))
    finally:
        gw.proc.stop()
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-kneecap-backend"] == "m0"
    assert over.status_code == 400, over.text
    assert "x-kneecap-backend" not in over.headers
    error = over.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "input"
    assert "requested 1001 tokens in the input for embedding generation" in error["message"]
    # A completion still needs room for one token.
    assert prompt.status_code == 400, prompt.text
    assert "leaves no room for output" in prompt.json()["error"]["message"]


# --- a backend a reload adds without `models` --------------------------------------------


@pytest.mark.parametrize(
    ("model", "status"), [("raw", 200), ("nobody/serves-this", 404)], ids=["served", "unknown"]
)
def test_a_backend_added_without_models_is_waited_for(
    tmp_path: Path, raw: Proc, sims: list[Proc], model: str, status: int
) -> None:
    """The new backend's first probe answers only when poked; a request for the model it
    serves waits for it (before: 404 model_not_found at once), and one for a model it
    does not serve hears 404 as soon as that probe answers, not after its queue wait."""
    first = {"backends": [backend("a", sims[0].url)], "health": QUIET_HEALTH}
    gw = start_gateway(tmp_path, first)
    added = {"name": "n", "url": raw.url, "pool": "short"}  # no models: discovered
    second = {
        "backends": [backend("a", sims[0].url), added],
        "health": {**QUIET_HEALTH, "path": "/health?await_poke"},  # the sim answers at once
    }
    try:
        gw.write_config(second)
        assert httpx.post(gw.url + "/admin/reload", timeout=5).json()["ok"] is True
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, gw.url + "/v1/completions", json=held(body), timeout=10)
            wait_until(lambda: sent.done() or gw.state()["pools"]["short"]["queue_depth"] == 1)
            waited = not sent.done()
            poke(raw)  # the probe's /health answers; then its /v1/models lists `raw`
            if status == 200 and waited:
                wait_until(lambda: backend_state(gw, "n")["in_flight"] == 1)
                poke(raw)  # the request's own answer
            response = sent.result(30)
    finally:
        gw.proc.stop()
    assert waited, response.text
    assert response.status_code == status, response.text
    if status == 200:
        assert response.headers["x-kneecap-backend"] == "n"
    else:
        assert response.json()["error"]["code"] == "model_not_found"
