"""The gateway's promises, kept in front of a real vLLM engine, seen through the openai SDK.

One gateway process serves the whole module. Counters are compared before and after each
request, so the tests do not depend on their order.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.procs import Gateway, wait_until
from tests.real_engine import vllm_server
from tests.real_engine.conftest import (
    BACKEND,
    SLOW,
    LongStreams,
    RealVllm,
    Samples,
    backend_state,
    engine_value,
    poll,
    scrape,
    start_real_gateway,
    total,
)

# <|im_end|>, the tiny model's EOS (make_tiny_model.py); see test_direct.py.
EOS_TOKEN_ID = 2
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
IGNORE_EOS = {"ignore_eos": True}  # exactly max_tokens, whatever the random weights say
LONG = 2000  # tokens: several seconds of generation on the CPU, which a disconnect must cut
ATTEMPTS = 6  # busy-moment checks: an attempt the engine finished first proves nothing
MAX_MODEL_LEN = vllm_server.MAX_MODEL_LEN  # the engine's --max-model-len
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, real_vllm: RealVllm) -> Iterator[Gateway]:
    gw = start_real_gateway(tmp_path_factory.mktemp("real-gateway"), real_vllm, limit=4)
    try:
        yield gw
    finally:
        gw.proc.stop()


def gateway_metrics(gateway: Gateway) -> Samples:
    return scrape(gateway.url + "/metrics")


def grew(before: Samples, after: Samples, name: str) -> float:
    return total(after, name, backend=BACKEND) - total(before, name, backend=BACKEND)


def test_models_are_discovered_from_the_engine(client: openai.OpenAI, real_vllm: RealVllm) -> None:
    assert [m.id for m in client.models.list()] == [real_vllm.model]


def test_streaming_chat_counts_exact_tokens_and_times_the_stream(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    before = gateway_metrics(gateway)
    # No include_usage: the gateway asks the engine for usage itself and strips it again.
    chunks = list(
        client.chat.completions.create(
            model=real_vllm.model,
            messages=MESSAGES,
            max_tokens=48,
            stream=True,
            extra_body=IGNORE_EOS,
        )
    )
    after = gateway_metrics(gateway)
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"]
    # Counted from the engine's usage, not from chunks (some real tokens carry no text).
    assert grew(before, after, "kneecap_completion_tokens_total") == 48
    assert grew(before, after, "kneecap_prompt_tokens_total") > 0
    assert grew(before, after, "kneecap_request_ttft_seconds_count") == 1
    ttft = grew(before, after, "kneecap_request_ttft_seconds_sum")
    e2e = grew(before, after, "kneecap_request_e2e_seconds_sum")
    assert 0 < ttft < e2e
    assert 1 <= grew(before, after, "kneecap_request_itl_seconds_count") <= 48
    window = backend_state(gateway)["window"]
    assert window["ttft_samples"] >= 1 and window["ttft_p50"] > 0
    # Gaps can be 0: a starved engine's API server flushes several tokens in one write.
    assert window["itl_p50"] is not None and window["itl_p50"] >= 0


def test_streaming_completion_relays_the_usage_the_client_asked_for(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    before = gateway_metrics(gateway)
    chunks = list(
        client.completions.create(
            model=real_vllm.model,
            prompt="Once upon a time",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    after = gateway_metrics(gateway)
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 24
    assert "".join(c.choices[0].text for c in choice_chunks)
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    assert grew(before, after, "kneecap_completion_tokens_total") == 24
    assert grew(before, after, "kneecap_prompt_tokens_total") == usage_chunk.usage.prompt_tokens
    assert grew(before, after, "kneecap_request_ttft_seconds_count") == 1


def test_finish_reason_on_a_last_chunk_without_text_reaches_the_client(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    before = gateway_metrics(gateway)
    chunks = list(
        client.chat.completions.create(
            model=real_vllm.model,
            messages=MESSAGES,
            max_tokens=16,
            stream=True,
            logit_bias={str(EOS_TOKEN_ID): 100},  # EOS first: the only token has no text
        )
    )
    after = gateway_metrics(gateway)
    last = chunks[-1].choices[0]
    assert (last.finish_reason, last.delta.content) == ("stop", "")
    assert grew(before, after, "kneecap_completion_tokens_total") == 1


def test_non_streaming_chat_and_completion_count_the_engines_usage(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    before = gateway_metrics(gateway)
    chat = client.chat.completions.create(
        model=real_vllm.model, messages=MESSAGES, max_tokens=16, extra_body=IGNORE_EOS
    )
    completion = client.completions.create(
        model=real_vllm.model, prompt="Hello", max_tokens=8, extra_body=IGNORE_EOS
    )
    after = gateway_metrics(gateway)
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].text
    assert chat.usage is not None and chat.usage.completion_tokens == 16
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert grew(before, after, "kneecap_completion_tokens_total") == 16 + 8
    prompt = chat.usage.prompt_tokens + completion.usage.prompt_tokens
    assert grew(before, after, "kneecap_prompt_tokens_total") == prompt
    assert grew(before, after, "kneecap_request_ttft_seconds_count") == 0  # streams only
    assert total(after, "kneecap_requests_total", backend=BACKEND, status="ok") >= 2


def test_unknown_model_is_refused_by_the_gateway(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_engine_400_passes_through_byte_for_byte(
    gateway: Gateway, real_vllm: RealVllm, stream: bool
) -> None:
    # A sampling parameter only the engine validates.
    body = {"model": real_vllm.model, "messages": MESSAGES, "temperature": -1, "stream": stream}
    direct = httpx.post(real_vllm.base_url + "/chat/completions", json=body, timeout=SLOW)
    relayed = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=SLOW)
    assert direct.status_code == relayed.status_code == 400
    assert relayed.content == direct.content
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    assert relayed.headers["x-kneecap-backend"] == BACKEND
    error = relayed.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "temperature", 400)


def test_engine_400_raises_bad_request_in_the_openai_client(
    client: openai.OpenAI, real_vllm: RealVllm
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=real_vllm.model, prompt="Hi", temperature=-1)
    assert caught.value.status_code == 400
    assert "temperature" in caught.value.message


def test_a_prompt_over_the_engines_context_is_refused_by_the_gateway(
    gateway: Gateway, real_vllm: RealVllm
) -> None:
    # The gateway learnt the engine's --max-model-len from its /v1/models.
    # Over the context even at 128 characters a token: a refusal from characters is sure.
    long_prompt = "knee " * (30 * MAX_MODEL_LEN)
    body = {"model": real_vllm.model, "prompt": long_prompt, "max_tokens": 1}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=SLOW)
    assert response.status_code == 400
    assert "x-kneecap-backend" not in response.headers  # the engine never saw it
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in error["message"]


def test_max_tokens_over_the_context_is_the_engines_to_judge(
    gateway: Gateway, real_vllm: RealVllm
) -> None:
    """A short prompt with more output than the context holds: engines differ (this one
    refuses max_tokens above max_model_len, naming max_tokens; vLLM clamps a sum that is
    over it), so the gateway forwards it and relays the engine's answer byte for byte."""
    body = {"model": real_vllm.model, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN + 1}
    direct = httpx.post(real_vllm.base_url + "/chat/completions", json=body, timeout=SLOW)
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=SLOW)
    assert response.headers.get("x-kneecap-backend") == BACKEND
    assert (response.status_code, response.content) == (direct.status_code, direct.content)


def test_gateway_scrapes_the_engines_own_gauges(gateway: Gateway, real_vllm: RealVllm) -> None:
    def seen_busy() -> bool:
        # Only a scrape of the engine's /metrics knows its KV-cache usage.
        metrics = gateway_metrics(gateway)
        return (
            total(metrics, "kneecap_engine_requests_running", backend=BACKEND) == 1
            and total(metrics, "kneecap_engine_requests_waiting", backend=BACKEND) == 0
            and 0 < total(metrics, "kneecap_engine_kv_cache_usage_ratio", backend=BACKEND) <= 1
        )

    url = gateway.url + "/v1/chat/completions"
    body = {"model": real_vllm.model, "messages": MESSAGES, "max_tokens": LONG, **IGNORE_EOS}
    for _ in range(ATTEMPTS):
        with LongStreams(url, body, 1) as busy:
            seen = poll(seen_busy, give_up=busy.any_ended)
            view = backend_state(gateway)["engine"]
        assert busy.statuses == [200]
        if seen:
            break
    else:
        pytest.fail(f"no scrape saw the engine busy during {ATTEMPTS} streams of {LONG} tokens")
    assert view is not None and view.keys() == {"running", "waiting", "kv_usage"}
    # And it follows the engine back to idle.
    wait_until(lambda: (backend_state(gateway)["engine"] or {}).get("running") == 0, timeout=SLOW)
    assert total(gateway_metrics(gateway), "kneecap_engine_requests_running", backend=BACKEND) == 0


def test_client_disconnect_stops_generation_in_the_engine(
    client: openai.OpenAI, gateway: Gateway, real_vllm: RealVllm
) -> None:
    def closed_requests() -> float:
        metrics = gateway_metrics(gateway)
        return total(metrics, "kneecap_requests_total", backend=BACKEND, status="client_closed")

    closed_before = closed_requests()
    # On a loaded machine the engine may finish all LONG tokens before the client has read
    # its first one; such an attempt proves nothing, so there are a few. Were the close not
    # passed on, every attempt would generate all LONG tokens.
    for _ in range(ATTEMPTS):
        before = engine_value(real_vllm, GENERATED)
        stream = client.chat.completions.create(
            model=real_vllm.model,
            messages=MESSAGES,
            max_tokens=LONG,
            stream=True,
            extra_body=IGNORE_EOS,
        )
        with stream:  # leaving the block closes the connection
            next(chunk for chunk in stream if chunk.choices[0].delta.content)
        wait_until(lambda: engine_value(real_vllm, RUNNING) == 0, timeout=SLOW)
        generated = engine_value(real_vllm, GENERATED) - before
        if generated < LONG:
            break
    assert generated < LONG, f"the engine generated all {LONG} tokens in {ATTEMPTS} attempts"
    # The permit came back, and the request was recorded as the client's doing.
    wait_until(lambda: backend_state(gateway)["in_flight"] == 0, timeout=SLOW)
    assert closed_requests() > closed_before
    assert backend_state(gateway)["healthy"]
