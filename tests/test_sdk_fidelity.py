"""What the official ``openai`` client sees through the gateway, at the edges a black-box
hunt with it found: each case is one the gateway answered differently than the engine
behind it would have.

Backends: ``kneecap sim`` (its tokenizer counts 4 UTF-8 bytes a token, its context is
40,960 tokens), :mod:`tests.raw_sse_backend` (the answer is the script each request
carries) and :mod:`tests.echo_backend` (what the gateway forwarded, read back).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backends.sim.fixed import MAX_MODEL_LEN
from backends.sim.tokenizer import count_chat_tokens
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
from tests.raw_sse_backend import MODEL as RAW_MODEL
from tests.test_proxy_edge_cases import QUIET_HEALTH, raw_backend
from tests.test_proxy_upstream_request import MODEL as ECHO_MODEL
from tests.test_proxy_upstream_request import echo_backend, start_echo
from tests.test_proxy_wire import idle, new_id, openai_client, record_of
from tests.test_relay_edge_cases import (
    DONE,
    LAST_CHUNK,
    SSE_HEAD,
    STREAM,
    chunked_stream,
    chunks,
    usage,
)

# The gateway's own context refusal says "about": it estimated; an engine counted.
GATEWAY_REFUSAL = "However, you requested about"
# A vLLM engine's error event for a request it found bad once the stream had started.
BAD_REQUEST_EVENT = (
    b'data: {"error": {"message": "bad grammar", "type": "BadRequestError", '
    b'"param": null, "code": 400}}\n\n'
)
ENGINE_FAILURE_EVENT = (
    b'data: {"error": {"message": "engine died", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sdk_fidelity")


@pytest.fixture(scope="module")
def sim(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_sim(module_tmp, ttft_ms=5, itl_ms=2))


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def echo(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_echo(module_tmp))


def sim_context_known(gw: Gateway) -> bool:
    """The gateway learns the simulator's context from its /v1/models, on a probe."""
    lengths = {b["name"]: b["max_model_len"] for b in gw.state()["backends"]}
    return lengths["sim"] == MAX_MODEL_LEN


@pytest.fixture(scope="module")
def gw(module_tmp: Path, sim: Proc, raw: Proc, echo: Proc) -> Iterator[Gateway]:
    config = {
        "backends": [
            backend("sim", sim.url),
            raw_backend("raw", raw.url),
            echo_backend(echo.url),
        ],
        "health": QUIET_HEALTH,
        "upstream": {"max_attempts": 1},
    }
    gateway = start_gateway(module_tmp, config)
    try:
        wait_until(lambda: sim_context_known(gateway))
        yield gateway
    finally:
        gateway.proc.stop()


# --- 1. a batch is one sequence per input -------------------------------------------

DOC_15K_TOKENS = "word " * 12_000  # 60,000 bytes: 15,000 tokens on the simulator
# Four of them: 60,000 tokens together, over the 40,960 context; each fits on its own.
BATCH = 4
# Alone over the context: 1.375M tokens on the simulator, 42,968 at 128 characters a token.
DOC_TOO_LONG = "word " * 1_100_000


def test_embeddings_of_inputs_that_each_fit_are_served_whatever_their_sum(gw: Gateway) -> None:
    """Four inputs of 15K tokens: 60K together, over the 40,960 context, but vLLM (and
    OpenAI) check each input on its own. Before the fix the gateway refused the batch
    itself, 400 context_length_exceeded."""
    client = openai_client(gw.url)
    answer = client.embeddings.create(model=MODEL, input=[DOC_15K_TOKENS] * BATCH)
    assert [item.index for item in answer.data] == list(range(BATCH))
    assert answer.usage.prompt_tokens == 60_000  # the sum is over the context indeed


def test_completions_of_token_id_prompts_that_each_fit_reach_the_engine(gw: Gateway) -> None:
    """Four prompts of 15,000 ids each, 60,000 together: vLLM serves them, each on its own
    context, and so does the simulator; the gateway must not refuse them by their sum."""
    client = openai_client(gw.url)
    prompts = [[1] * 15_000 for _ in range(BATCH)]
    served = client.completions.with_raw_response.create(model=MODEL, prompt=prompts, max_tokens=5)
    assert served.headers["x-kneecap-backend"] == "sim"
    assert [c.index for c in served.parse().choices] == list(range(BATCH))


def test_completions_of_text_prompts_over_the_context_together_reach_the_engine(
    gw: Gateway,
) -> None:
    """Each prompt fits, all of them together do not: served, one choice a prompt, never
    refused by the gateway's estimate of the whole."""
    client = openai_client(gw.url)
    prompt = [DOC_15K_TOKENS] * BATCH
    served = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert served.headers["x-kneecap-backend"] == "sim"
    assert [c.index for c in served.parse().choices] == list(range(BATCH))


@pytest.mark.parametrize("batched", [False, True], ids=["string", "list-of-one"])
def test_a_single_input_over_the_context_is_still_refused_by_the_gateway(
    gw: Gateway, batched: bool
) -> None:
    client = openai_client(gw.url)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[DOC_TOO_LONG] if batched else DOC_TOO_LONG)
    assert refused.value.code == "context_length_exceeded"
    assert GATEWAY_REFUSAL in refused.value.message
    assert "x-kneecap-backend" not in refused.value.response.headers  # never sent upstream


# --- 2. a calibrated ratio is a floor, not a verdict --------------------------------


def test_an_english_prompt_that_fits_is_served_after_a_cjk_one_calibrated_the_ratio(
    tmp_path: Path, sim: Proc
) -> None:
    """One CJK prompt (3 bytes a character: 1.33 characters a token) calibrates the
    model's ratio down to 1.33; a 30K-token English prompt (4 characters a token) then
    counts ~90K at that ratio. It fits the 40,960 context and must be served (before
    the fix: refused by the gateway, never sent)."""
    config = {"backends": [backend("sim", sim.url)], "health": QUIET_HEALTH}
    gateway = start_gateway(tmp_path, config)
    try:
        wait_until(lambda: sim_context_known(gateway))
        client = openai_client(gateway.url)
        cjk = [{"role": "user", "content": "你好世界" * 5_000}]
        client.chat.completions.create(model=MODEL, messages=cjk, max_tokens=2)

        def calibration() -> dict[str, Any]:
            return gateway.state()["routing"]["calibration"].get(MODEL, {})

        wait_until(lambda: calibration().get("observations") == 1)
        assert calibration()["chars_per_token"] == pytest.approx(4 / 3, rel=0.01)

        english = [{"role": "user", "content": "word " * 24_000}]
        answer = client.chat.completions.create(model=MODEL, messages=english, max_tokens=5)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == count_chat_tokens(english)  # 30,007
    finally:
        gateway.proc.stop()


# --- 3. an engine's 4xx error event is the request's fault -------------------------


def _stream_to_error(gw: Gateway, error_event: bytes) -> tuple[openai.APIError, str]:
    """A stream the engine ends with ``error_event``, read by the official client: the
    error it raised and the request's id."""
    request_id = new_id("error-event")
    script = chunked_stream(*STREAM[:2], error_event, DONE)
    stream = openai_client(gw.url).chat.completions.create(
        model=RAW_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"raw_script": script},
        extra_headers={"x-request-id": request_id},
    )
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            pass
    return raised.value, request_id


def _healthy(gw: Gateway) -> bool:
    return next(b["healthy"] for b in gw.state()["backends"] if b["name"] == "raw")


def test_engine_error_events_blaming_the_request_never_eject_the_backend(
    tmp_path: Path, raw: Proc
) -> None:
    """One failure ejects (threshold 1) and no probe readmits (60 s apart). Streams
    ending in a 400-coded error event are ``client_error``: the backend stays in and
    serves the next request. Before the fix the first such stream ejected it, and every
    request got 503 until the next probe. A 500-coded event still ejects it (a spare
    beside it: passive ejection never takes a pool's last backend)."""
    spare = start_raw_sse(tmp_path)
    config = {
        "backends": [raw_backend("raw", raw.url), raw_backend("spare", spare.url)],
        "health": {"interval_s": 60, "failure_threshold": 1},
        "upstream": {"max_attempts": 1},
        "routing": {"policy": "least_loaded"},  # deterministic: `raw` first on ties
    }
    gateway = start_gateway(tmp_path, config)
    try:
        for _ in range(3):
            error, request_id = _stream_to_error(gateway, BAD_REQUEST_EVENT)
            assert error.message == "bad grammar"
            assert record_of(gateway, request_id)["status"] == "client_error"
        assert _healthy(gateway)
        request_id = new_id("after-errors")
        stream = openai_client(gateway.url).chat.completions.create(
            model=RAW_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"raw_script": chunked_stream(*STREAM, DONE)},
            extra_headers={"x-request-id": request_id},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == "one two three"
        assert record_of(gateway, request_id)["status"] == "ok"

        # The contrast: the engine's own failure counts against it, as it always did.
        error, request_id = _stream_to_error(gateway, ENGINE_FAILURE_EVENT)
        assert error.message == "engine died"
        assert record_of(gateway, request_id)["status"] == "upstream_error"
        assert not _healthy(gateway)
        assert idle(gateway)
    finally:
        gateway.proc.stop()
        spare.stop()


# --- 4. continuous usage stats the client asked for without usage -------------------


def forwarded_stream_options(gw: Gateway, options: dict[str, bool]) -> tuple[str, str]:
    """The body the client sent and the one the echo backend got, for a streamed request."""
    sent = json.dumps(
        {
            "model": ECHO_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": options,
        }
    )
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        content=sent,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    return sent, response.json()["body"]


@pytest.mark.parametrize(
    "options",
    [{"continuous_usage_stats": True}, {"include_usage": False, "continuous_usage_stats": True}],
    ids=["alone", "usage-false"],
)
def test_continuous_usage_stats_without_usage_are_not_asked_upstream(
    gw: Gateway, options: dict[str, bool]
) -> None:
    """vLLM puts usage on every chunk only under include_usage *and*
    continuous_usage_stats; the gateway asks for usage itself (and strips only the last
    usage chunk), so forwarding the client's continuous_usage_stats put usage on every
    chunk the client got (before the fix)."""
    _, forwarded = forwarded_stream_options(gw, options)
    assert json.loads(forwarded)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }


def test_continuous_usage_stats_with_usage_go_upstream_as_the_client_sent_them(
    gw: Gateway,
) -> None:
    sent, forwarded = forwarded_stream_options(
        gw, {"include_usage": True, "continuous_usage_stats": True}
    )
    assert forwarded == sent


# --- 5. a stream the client read to [DONE], its backend ending the body later ------


def test_a_stream_read_to_done_is_ok_though_the_backend_ends_its_body_later(
    gw: Gateway, raw: Proc
) -> None:
    """The official client stops reading at ``[DONE]`` and closes the response. The
    backend's end of body (the last chunk) comes only when poked, after that: the client
    had everything, and the stream is ``ok`` (before the fix: ``client_closed``, its
    admission outcome ignored and its usage never calibrating)."""
    request_id = new_id("done-then-close")
    script = [
        ["send", SSE_HEAD],
        *chunks(*STREAM, usage(), DONE),
        ["await_poke"],
        ["send", LAST_CHUNK],
    ]
    stream = openai_client(gw.url).chat.completions.create(
        model=RAW_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"raw_script": script},
        extra_headers={"x-request-id": request_id},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "one two three"
    # The backend's body is still open: the gateway ends the stream on the client's
    # close, not on the backend's last chunk.
    record = record_of(gw, request_id)
    # Only now may the backend end its body; and its script must not be left waiting.
    assert httpx.get(raw.url + "/poke", timeout=5).status_code == 200
    assert record["status"] == "ok"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (7, 3)
    wait_until(lambda: idle(gw))
