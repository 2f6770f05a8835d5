"""The official openai client, sync and async, streaming and not, through the gateway."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from tests.procs import MODEL, Gateway, Proc

MESSAGES = [{"role": "user", "content": "Where is the knee?"}]


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def test_sync_streaming_chat_yields_tokens_and_finish(gateway: Gateway) -> None:
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=12
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 12
    assert chunks[-1].choices[0].finish_reason == "length"
    # The gateway asked for usage itself; the client did not, so it never sees it.
    assert all(c.usage is None for c in chunks)


def test_sync_streaming_with_usage_requested_by_client(gateway: Gateway) -> None:
    stream = client(gateway).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        stream=True,
        max_tokens=7,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].choices == []


def test_sync_non_streaming_chat(gateway: Gateway) -> None:
    reply = client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.choices[0].finish_reason == "length"


def test_completions_and_embeddings(gateway: Gateway) -> None:
    c = client(gateway)
    completion = c.completions.create(model=MODEL, prompt="The knee is", max_tokens=4)
    assert completion.choices[0].text and completion.usage.completion_tokens == 4
    streamed = list(c.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True))
    assert sum(1 for s in streamed if s.choices and s.choices[0].text) == 3
    embedding = c.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(embedding.data) == 2 and embedding.data[0].embedding != embedding.data[1].embedding


def test_models_lists_the_union_of_healthy_backends(gateway: Gateway) -> None:
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.anyio
async def test_async_client_streaming_and_not(gateway: Gateway) -> None:
    async_client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    async with async_client:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=9
        )
        tokens = [c async for c in stream if c.choices and c.choices[0].delta.content]
        assert len(tokens) == 9
        reply = await async_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3
        )
        assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_bytes_equal_a_direct_call(
    gateway: Gateway, sims: list[Proc], stream: bool, include_usage: bool
) -> None:
    """For a deterministic request the client sees exactly what the backend sent."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 7, "stream": stream}
    if include_usage and stream:
        body["stream_options"] = {"include_usage": True}
    via = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
    direct = httpx.post(sims[0].url + "/v1/chat/completions", json=body, timeout=10)
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content
    assert via.headers["content-type"] == direct.headers["content-type"]


def test_unknown_fields_pass_through_and_request_id_round_trips(gateway: Gateway) -> None:
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 2,
        "seed": 1,
        "kneecap_unknown": {"a": [1]},
    }
    response = httpx.post(
        gateway.url + "/v1/completions", json=body, headers={"x-request-id": "req-123"}, timeout=10
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-123"
    generated = httpx.get(gateway.url + "/v1/models", timeout=5).headers["x-request-id"]
    assert len(generated) == 32


def test_generated_request_ids_do_not_count_requests(gateway: Gateway) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    ids = [
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=10).headers["x-request-id"]
        for _ in range(4)
    ]
    assert len(set(ids)) == 4
    # A shared prefix and a counter made consecutive ids differ in their last digits only.
    values = [int(request_id, 16) for request_id in ids]
    assert all(abs(b - a) > 2**64 for a, b in itertools.pairwise(values)), ids


@pytest.mark.parametrize(
    "body", [{"model": MODEL, "prompt": "count me " * 50}, {"model": MODEL, "messages": MESSAGES}]
)
def test_tokenize_is_answered_by_a_backend_of_the_model(
    gateway: Gateway, sims: list[Proc], body: dict
) -> None:
    via = httpx.post(gateway.url + "/tokenize", json=body, timeout=10)
    direct = httpx.post(sims[0].url + "/tokenize", json=body, timeout=10)
    assert via.status_code == direct.status_code == 200
    assert via.json() == direct.json()
    assert via.json()["count"] > 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "prompt": "x"}, 404, "model_not_found"),
        ({"prompt": "x"}, 400, "missing_required_parameter"),
        ({"model": 5, "prompt": "x"}, 400, "invalid_type"),  # as /v1/* says it
        ([1, 2], 400, "invalid_json"),
    ],
)
def test_tokenize_refusals_are_openai_errors(
    gateway: Gateway, body: object, status: int, code: str
) -> None:
    response = httpx.post(gateway.url + "/tokenize", json=body, timeout=10)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
