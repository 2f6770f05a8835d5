"""The gateway refuses for want of context only what surely does not fit, and lets through
the request shapes vLLM takes besides the usual ones.

1. An estimate from characters refused prompts that fit: its "floor" was the count at 4
   characters a token less 10 %, while whitespace runs and separator lines tokenize at 16
   to 33 characters a token (on the CI engine: 20,000 spaces + ``def f():`` are 1,252
   tokens), and tool definitions a template may not render were counted as prompt (40
   tools with ``tool_choice: "none"``: 12 real tokens). Now it refuses only on a lower
   bound: what every template renders at 128 characters a token.
2. A batch of token ids, counted exactly, had its longest sequence scaled by a float ratio:
   2,214 * (2,047 / 2,214) = 2,047.0000000000002, rounded up to 2,048 and refused on a
   2,048 context. Exact counts stay exact.
3. ``/v1/embeddings`` with ``messages`` (vLLM's chat embeddings) and ``/v1/completions``
   with ``prompt_embeds`` were refused as missing ``input`` / ``prompt``.

The echo backend answers every POST with what it received; the gateway is told its context
is 2,048 tokens (the CI engine's ``--max-model-len``), so what reaches it was not refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.errors import InvalidRequest
from gateway.payload import parse_payload
from gateway.tokens import MOST_CHARS_PER_TOKEN, CharsPerToken
from policies.prompt_size import shape_of
from tests.procs import MODEL as MODEL_SIM
from tests.procs import Gateway, Proc, backend, start_gateway, start_sim
from tests.test_proxy_upstream_request import MODEL, echo_backend, start_echo

CONTEXT = 2048
SPACES_THEN_CODE = " " * 20_000 + "def f():"  # 1,252 tokens on the CI engine; "about 5002"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"fn_{i}",
            "description": "d" * 300,
            "parameters": {"type": "object", "properties": {}},
        },
    }
    for i in range(40)
]
SURELY_OVER = "x" * (MOST_CHARS_PER_TOKEN * CONTEXT + MOST_CHARS_PER_TOKEN)  # 2,049 at the most


# --- pure ---------------------------------------------------------------------------------


def test_the_floor_counts_what_every_template_renders_at_the_most_characters_a_token() -> None:
    estimator = CharsPerToken(prior=4.0)
    spaces = estimator.estimate_with_floor("m", shape_of({"prompt": SPACES_THEN_CODE}))
    assert spaces.tokens == 5002  # routing still uses the calibrated estimate
    assert spaces.fewest == 20_008 // MOST_CHARS_PER_TOKEN < 1252
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    tools = estimator.estimate_with_floor("m", shape_of(chat))
    assert tools.tokens > 4000  # the tools' JSON counts where the request goes
    assert tools.fewest == 0  # but not what it is refused on: "hi" and no template


def test_the_longest_of_a_batch_of_ids_is_exactly_its_ids() -> None:
    shape = shape_of({"prompt": [[100] * 2047, [100] * 167]})
    assert shape.token_ids == 2214
    assert shape.longest_of(2214) == 2047
    assert shape_of({"input": ["ab", "abcdef"]}).longest_of(7) == 6  # 5.25, rounded up


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt_embeds": "AAAA"}),
    ],
)
def test_vllms_alternative_fields_are_accepted(endpoint: str, body: dict[str, Any]) -> None:
    payload = {"model": MODEL, **body}
    assert parse_payload(json.dumps(payload).encode(), endpoint) == payload


@pytest.mark.parametrize(
    ("endpoint", "param", "words"),
    [
        ("/v1/embeddings", "input", "`input` or `messages`"),
        ("/v1/completions", "prompt", "`prompt` or `prompt_embeds`"),
        ("/v1/chat/completions", "messages", "`messages` parameter"),
    ],
)
def test_a_request_with_neither_field_names_both(endpoint: str, param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_payload(json.dumps({"model": MODEL, "prompt_embeds": None}).encode(), endpoint)
    assert refused.value.param == param
    assert refused.value.code == "missing_required_parameter"
    assert words in refused.value.message


# --- through the gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("context_refusal")
    echo: Proc | None = None
    gateway: Gateway | None = None
    try:
        echo = start_echo(tmp)
        gateway = start_gateway(tmp, {"backends": [echo_backend(echo.url, max_model_len=CONTEXT)]})
        yield gateway
    finally:
        if gateway is not None:
            gateway.proc.stop()
        if echo is not None:
            echo.stop()


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gw.url + path, json={"model": MODEL, **body}, timeout=30)


def forwarded(response: httpx.Response) -> dict[str, Any]:
    """What the echo backend received; fails on the gateway's own refusal."""
    assert response.status_code == 200, response.text
    assert response.headers["x-kneecap-backend"] == "echo"
    return json.loads(response.json()["body"])


@pytest.mark.parametrize(
    "prompt",
    # 1,252 and 1,250 tokens on the CI engine's tokenizer: 16 and 32 characters a token.
    [SPACES_THEN_CODE, "-" * 40_000],
    ids=["spaces", "separator"],
)
def test_whitespace_and_separator_text_that_fits_is_forwarded(gw: Gateway, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2}
    assert forwarded(post(gw, "/v1/completions", body))["prompt"] == prompt


def test_tools_a_template_may_not_render_do_not_refuse(gw: Gateway) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 2,
    }
    assert forwarded(post(gw, "/v1/chat/completions", body))["tools"] == TOOLS


def test_a_prompt_surely_over_the_context_is_still_refused(gw: Gateway) -> None:
    response = post(gw, "/v1/completions", {"prompt": SURELY_OVER, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert "x-kneecap-backend" not in response.headers  # never sent
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    # It speaks of the estimate (4 characters a token), not of the bound it refused on.
    assert f"you requested about {len(SURELY_OVER) // 4} tokens" in error["message"]


def test_a_batch_of_ids_whose_longest_fits_is_forwarded(gw: Gateway) -> None:
    batch = [[100] * (CONTEXT - 1), [100] * 167]
    body = {"prompt": batch, "max_tokens": 1}
    assert forwarded(post(gw, "/v1/completions", body))["prompt"] == batch
    over = post(gw, "/v1/completions", {"prompt": [[100] * CONTEXT, [100] * 167]})
    assert over.status_code == 400, over.text
    assert "you requested 2048 tokens in the prompt" in over.json()["error"]["message"]


def test_chat_embeddings_are_forwarded_and_estimated_as_chat(gw: Gateway) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert forwarded(post(gw, "/v1/embeddings", {"messages": messages}))["messages"] == messages
    long = post(gw, "/v1/embeddings", {"messages": [{"role": "user", "content": SURELY_OVER}]})
    assert long.status_code == 400, long.text
    error = long.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "in the input for embedding generation" in error["message"]


def test_prompt_embeds_are_forwarded_whatever_their_size(gw: Gateway) -> None:
    embeds = "A" * len(SURELY_OVER)  # no size the gateway can read: the engine's to judge
    body = {"prompt_embeds": embeds, "max_tokens": 2}
    assert forwarded(post(gw, "/v1/completions", body))["prompt_embeds"] == embeds


def test_neither_field_is_still_a_clear_400(gw: Gateway) -> None:
    response = post(gw, "/v1/completions", {"max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("missing_required_parameter", "prompt")
    assert "`prompt` or `prompt_embeds`" in error["message"]


def test_a_batch_a_backend_counts_whole_refuses_by_its_longests_own_floor(tmp_path: Path) -> None:
    """``estimator.mode: backend`` counts a batch as a whole: the longest input is at least
    the count less what the others can be (a token per byte). An input 5x over the context
    beside a short one was forwarded; an id batch was reported as "about" its exact count."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    try:
        config = {
            "backends": [backend("a", sim.url, max_model_len=100)],
            "routing": {"estimator": {"mode": "backend"}},
        }
        gateway = start_gateway(tmp_path, config)
        try:
            url = gateway.url + "/v1/embeddings"
            batch = {"model": MODEL_SIM, "input": ["word " * 500, "hi"]}
            refused = httpx.post(url, json=batch, timeout=30)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "context_length_exceeded"
            fits = {"model": MODEL_SIM, "input": ["word " * 15, "hi " * 15]}
            assert httpx.post(url, json=fits, timeout=30).status_code == 200
            ids = {"model": MODEL_SIM, "input": [[7] * 500, [8] * 3]}
            message = httpx.post(url, json=ids, timeout=30).json()["error"]["message"]
            assert "you requested 500 tokens" in message, message
        finally:
            gateway.proc.stop()
    finally:
        sim.stop()
