"""``stream_options`` read as the engine reads them.

vLLM validates ``stream_options`` with pydantic in lax mode: ``include_usage`` and
``continuous_usage_stats`` may be ``1``, ``"true"``, ``"Yes"``…, and anything else
that is no bool by those rules (or options that are no object) is refused 400. The
gateway asks for usage only when the engine would read that the client did not; what
it cannot read so goes upstream untouched, for the engine to refuse.

Backends: :mod:`tests.echo_backend` (what the gateway forwarded, read back) and
:mod:`tests.raw_sse_backend` (the answer is the script each request carries).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.procs import Gateway, Proc, served, start_gateway, start_raw_sse
from tests.raw_sse_backend import MODEL as RAW_MODEL
from tests.test_proxy_edge_cases import QUIET_HEALTH, raw_backend, whole_answer
from tests.test_proxy_upstream_request import MODEL as ECHO_MODEL
from tests.test_proxy_upstream_request import echo_backend, start_echo
from tests.test_proxy_wire import idle, new_id, openai_client, record_of
from tests.test_relay_edge_cases import DONE, STREAM, chunked_stream, usage

CHAT = "/v1/chat/completions"
# vLLM's answer to stream_options it cannot validate.
REFUSAL = json.dumps(
    {
        "error": {
            "message": "1 validation error for ChatCompletionRequest\nstream_options\n"
            "  Input should be a valid dictionary or object to extract fields from",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
).encode()


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stream_options")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def echo(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_echo(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc, echo: Proc) -> Iterator[Gateway]:
    config = {
        "backends": [raw_backend("raw", raw.url), echo_backend(echo.url)],
        "health": QUIET_HEALTH,
        "upstream": {"max_attempts": 1},
    }
    gateway = start_gateway(module_tmp, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


def forwarded(gw: Gateway, options: Any) -> tuple[str, str]:
    """The streamed request's body as the client sent it and as the echo backend got it."""
    sent = json.dumps(
        {
            "model": ECHO_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": options,
        }
    )
    response = httpx.post(
        gw.url + CHAT, content=sent, headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return sent, response.json()["body"]


# --- 1. a flag the engine reads as true: the client asked ---------------------------

LAX_TRUE = [1, 1.0, "true", "TRUE", "Yes", "y", "on", "t", "1"]


@pytest.mark.parametrize("flag", LAX_TRUE, ids=repr)
def test_usage_asked_in_any_spelling_the_engine_reads_as_true_goes_up_untouched(
    gw: Gateway, flag: object
) -> None:
    """The client asked for usage: nothing to add, and its usage chunk is its own (before,
    only a JSON ``true`` counted, and the gateway rewrote the options)."""
    sent, got = forwarded(gw, {"include_usage": flag})
    assert got == sent


@pytest.mark.parametrize("flag", [1, "true"], ids=repr)
def test_an_sdk_client_asking_so_gets_its_usage_chunk(gw: Gateway, raw: Proc, flag: object) -> None:
    """The engine sends the usage chunk (it read the flag as true); the client gets it
    (before, the gateway took it for its own and stripped it)."""
    request_id = new_id("usage")
    script = chunked_stream(*STREAM, usage(7, 3), DONE)
    stream = openai_client(gw.url).chat.completions.create(
        model=RAW_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"stream_options": {"include_usage": flag}, "raw_script": script},
        extra_headers={"x-request-id": request_id},
    )
    chunks = list(stream)
    usages = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks if c.usage]
    assert usages == [(7, 3)]
    record = record_of(gw, request_id)
    assert (record["status"], record["completion_tokens"]) == ("ok", 3)


# --- 2. a flag the engine reads as false: the gateway asks --------------------------


@pytest.mark.parametrize(
    "options",
    [
        None,
        {"include_usage": None},
        {"include_usage": 0},
        {"include_usage": "false"},
        {"include_usage": "OFF"},
    ],
    ids=repr,
)
def test_usage_not_asked_for_is_asked_by_the_gateway(gw: Gateway, options: object) -> None:
    _, got = forwarded(gw, options)
    assert json.loads(got)["stream_options"] == {"include_usage": True}


def test_continuous_usage_in_a_lax_spelling_is_turned_off_with_usage_unasked(
    gw: Gateway,
) -> None:
    options = {"include_usage": "no", "continuous_usage_stats": "yes"}
    _, got = forwarded(gw, options)
    assert json.loads(got)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }


# --- 3. options the engine cannot read: the engine's to refuse ----------------------

UNREADABLE = [
    "x",
    [1],
    7,
    True,
    {"include_usage": "maybe"},
    {"include_usage": 2},
    {"include_usage": " true"},
    {"include_usage": []},
    {"continuous_usage_stats": "sometimes"},
    {"include_usage": False, "continuous_usage_stats": 0.5},
]


@pytest.mark.parametrize("options", UNREADABLE, ids=repr)
def test_stream_options_the_engine_cannot_read_go_up_untouched(
    gw: Gateway, options: object
) -> None:
    """Before, the gateway replaced them with ``{"include_usage": true}``, and the engine
    served a request it would have refused."""
    sent, got = forwarded(gw, options)
    assert got == sent


def test_the_engines_refusal_reaches_an_sdk_client(gw: Gateway) -> None:
    """What a vLLM behind the gateway answers such a request (its 400 is relayed as it
    is, counted as the client's error)."""
    request_id = new_id("refused")
    with pytest.raises(openai.BadRequestError, match="valid dictionary") as refused:
        openai_client(gw.url).chat.completions.create(
            model=RAW_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={
                "stream_options": "x",
                "raw_script": [["send", whole_answer(REFUSAL, "400 Bad Request")]],
            },
            extra_headers={"x-request-id": request_id},
        )
    assert refused.value.status_code == 400
    assert record_of(gw, request_id)["status"] == "client_error"
    assert idle(gw)


@pytest.mark.parametrize("with_usage", [True, False], ids=["usage", "no-usage"])
def test_an_engine_serving_them_anyway_reaches_the_client_byte_for_byte(
    gw: Gateway, with_usage: bool
) -> None:
    """An engine laxer than vLLM streams: the gateway asked for nothing, so it strips
    nothing, and the stream is measured all the same (usage or none)."""
    request_id = new_id("lax")
    events = [*STREAM, usage(7, 3), DONE] if with_usage else [*STREAM, DONE]
    request = {
        "model": RAW_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": "maybe"},
        "raw_script": chunked_stream(*events),
    }
    with httpx.stream(
        "POST", gw.url + CHAT, json=request, headers={"x-request-id": request_id}, timeout=10
    ) as response:
        assert response.status_code == 200
        data = response.read()
    assert data == b"".join(events)
    record = record_of(gw, request_id)
    assert record["status"] == "ok" and record["ttft_s"] is not None
    assert record["completion_tokens"] == (3 if with_usage else None)
