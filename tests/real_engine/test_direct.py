"""The real engine's wire behaviour, talked to directly (no gateway).

These pin down what the gateway relays and measures, so a vLLM upgrade that changes
any of it fails here first rather than as a puzzling gateway test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.real_engine.conftest import RealVllm

# The tiny model's tokenizer has special tokens <|endoftext|>, <|im_start|>, <|im_end|> at
# ids 0, 1, 2 (make_tiny_model.py); <|im_end|> is its EOS.
EOS_TOKEN_ID = 2
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def client(real_vllm: RealVllm) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_vllm.base_url, api_key="unused", max_retries=0) as c:
        yield c


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_streaming_chat_yields_content_and_a_usage_chunk(
    client: openai.OpenAI, real_vllm: RealVllm
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=real_vllm.model,
            messages=MESSAGES,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # exactly max_tokens, whatever the weights say
        )
    )
    *choice_chunks, usage_chunk = chunks
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 64
    # Chunks are not tokens: some tokens (partial UTF-8) carry an empty string.
    with_text = [c for c in choice_chunks if c.choices[0].delta.content]
    assert len(with_text) <= 64
    finishes = [c.choices[0].finish_reason for c in choice_chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert choice_chunks[-1].choices[0].finish_reason == "length"


def test_finish_reason_arrives_when_the_last_token_has_no_text(
    client: openai.OpenAI, real_vllm: RealVllm
) -> None:
    # Forcing EOS as the first token: the stream ends on a chunk with empty content
    # that still carries finish_reason, so a relay must not drop empty deltas.
    chunks = list(
        client.chat.completions.create(
            model=real_vllm.model,
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            logit_bias={str(EOS_TOKEN_ID): 100},
        )
    )
    *choice_chunks, usage_chunk = chunks
    last = choice_chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert last.delta.content == ""
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 1


def test_non_streaming_chat_and_completion_count_tokens(
    client: openai.OpenAI, real_vllm: RealVllm
) -> None:
    chat = client.chat.completions.create(
        model=real_vllm.model,
        messages=MESSAGES,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 16
    completion = client.completions.create(
        model=real_vllm.model, prompt="Hello", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 8


def test_unknown_model_is_a_404_openai_error_body(real_vllm: RealVllm) -> None:
    response = httpx.post(
        f"{real_vllm.base_url}/chat/completions",
        json={"model": "no-such-model", "messages": MESSAGES},
        timeout=30,
    )
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body.keys() == {"error"}
    assert body["error"].keys() == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "NotFoundError"
    assert body["error"]["param"] == "model"
    assert body["error"]["code"] == 404  # an int, where OpenAI itself sends a string
    assert "no-such-model" in body["error"]["message"]


def test_unknown_model_raises_not_found_in_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


def test_metrics_parse_and_idle_engine_reads_zero(real_vllm: RealVllm) -> None:
    assert wait_until(lambda: real_vllm.metrics()["vllm:num_requests_running"] == 0, 30)
    metrics = real_vllm.metrics()
    assert metrics["vllm:num_requests_waiting"] == 0
    assert 0.0 <= metrics["vllm:kv_cache_usage_perc"] <= 1.0


def test_client_disconnect_stops_generation(client: openai.OpenAI, real_vllm: RealVllm) -> None:
    # ~2000 tokens would take several seconds: closing early must abort it in the engine.
    stream = client.chat.completions.create(
        model=real_vllm.model,
        messages=MESSAGES,
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with stream:
        for _, _chunk in zip(range(5), stream, strict=False):
            pass

        # The engine publishes its gauges between steps: poll (bounded) rather than read once.
        def busy() -> bool:
            gauges = real_vllm.metrics()
            running, kv = gauges["vllm:num_requests_running"], gauges["vllm:kv_cache_usage_perc"]
            return running == 1 and kv > 0

        assert wait_until(busy, 10)
    assert wait_until(lambda: real_vllm.metrics()["vllm:num_requests_running"] == 0, 30)
