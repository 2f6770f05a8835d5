"""The simulator answers several sequences (``n`` > 1, a list of prompts) as vLLM does.

The same requests go to the real engine and to ``kneecap sim``; their answers must have
the same shape: which choices come, in what order, one per chunk, the role chunks of a
chat stream, one finishing chunk per choice, the usage (each prompt counted once, every
sequence's output), and the same refusals word for word. Texts and token counts differ
(a real tokenizer, random weights): usage is compared as arithmetic on each server's own
single-prompt counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import Proc, served, start_sim
from tests.real_engine.conftest import SLOW, RealVllm

HI = [{"role": "user", "content": "Hello there"}]
# Fields vLLM 0.32 sends that the simulator leaves out, or the other way round (all null
# or empty in these answers), on single-sequence answers as much as on these.
NOT_SIMULATED = frozenset(
    {
        "prompt_token_ids",
        "prompt_text",
        "token_ids",
        "system_fingerprint",
        "service_tier",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
        "prompt_logprobs",
        "routed_experts",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
        "refusal",
        "tool_calls",
        "prompt_tokens_details",
        "completion_tokens_details",
    }
)


@pytest.fixture(scope="module")
def sim(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("multi_choice")
    yield from served(start_sim(tmp, model=real_vllm.model, ttft_ms=1, itl_ms=1))


def post(url: str, model: str, path: str, **body: Any) -> httpx.Response:
    with httpx.Client(timeout=SLOW, trust_env=False) as client:
        return client.post(url + path, json={"model": model, **body})


def keys(obj: dict[str, Any]) -> list[str]:
    return sorted(set(obj) - NOT_SIMULATED)


def stream_shape(response: httpx.Response, chat: bool) -> list[Any]:
    """Each event as what must agree: its keys, its one choice's index, keys, role and
    finish reason; the usage chunk's keys; ``[DONE]``."""
    assert response.status_code == 200, response.text
    shape: list[Any] = []
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            shape.append("DONE")
            continue
        event = json.loads(line[6:])
        if not event["choices"]:
            shape.append(("usage", keys(event), keys(event["usage"])))
            continue
        assert len(event["choices"]) == 1
        choice = event["choices"][0]
        role = choice["delta"].get("role") if chat else None
        shape.append((keys(event), choice["index"], keys(choice), role, choice["finish_reason"]))
    return shape


def per_choice(shape: list[Any]) -> dict[int, list[tuple[Any, ...]]]:
    """Each choice's events in order, without the token chunks' count (a real tokenizer
    sends chunks without text for partial characters)."""
    seen: dict[int, list[tuple[Any, ...]]] = {}
    for item in shape:
        if isinstance(item, tuple) and item[0] != "usage":
            events = seen.setdefault(item[1], [])
            summary = (item[0], item[2], item[3], item[4])
            if not events or events[-1] != summary:
                events.append(summary)
    return seen


def usage_of(response: httpx.Response, streamed: bool) -> dict[str, int]:
    if streamed:
        last = [line for line in response.text.splitlines() if line.startswith("data: {")][-1]
        usage: dict[str, int] = json.loads(last[6:])["usage"]
    else:
        usage = response.json()["usage"]
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def servers(real_vllm: RealVllm, sim: Proc) -> list[str]:
    return [real_vllm.root_url, sim.url]


def test_a_chat_stream_with_n_has_vllms_shape(real_vllm: RealVllm, sim: Proc) -> None:
    asked = {"messages": HI, "max_tokens": 3, "ignore_eos": True, "seed": 1}
    shapes = []
    for url in servers(real_vllm, sim):
        answer = post(
            url, real_vllm.model, "/v1/chat/completions", n=2, stream=True,
            stream_options={"include_usage": True}, **asked,
        )  # fmt: skip
        shape = stream_shape(answer, chat=True)
        # The role chunks first, one per choice in index order; usage, then [DONE], last.
        assert [(s[1], s[3]) for s in shape[:2]] == [(0, "assistant"), (1, "assistant")]
        assert shape[-1] == "DONE" and shape[-2][0] == "usage"
        single = usage_of(post(url, real_vllm.model, "/v1/chat/completions", **asked), False)
        assert usage_of(answer, True) == {
            "prompt_tokens": single["prompt_tokens"],  # the prompt once, not n times
            "completion_tokens": 6,
            "total_tokens": single["prompt_tokens"] + 6,
        }
        shapes.append((shape[:2], per_choice(shape[2:]), shape[-2:]))
    real, simulated = shapes
    assert simulated == real


def test_a_whole_chat_with_n_has_vllms_shape(real_vllm: RealVllm, sim: Proc) -> None:
    asked = {"messages": HI, "max_tokens": 3, "ignore_eos": True, "seed": 1}
    shapes = []
    for url in servers(real_vllm, sim):
        body = post(url, real_vllm.model, "/v1/chat/completions", n=3, **asked).json()
        single = usage_of(post(url, real_vllm.model, "/v1/chat/completions", **asked), False)
        assert body["usage"]["prompt_tokens"] == single["prompt_tokens"]
        assert body["usage"]["completion_tokens"] == 9
        choices = body["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        shapes.append(
            (keys(body), [(keys(c), keys(c["message"]), c["message"]["role"]) for c in choices])
        )
    real, simulated = shapes
    assert simulated == real


@pytest.mark.parametrize("stream", [True, False])
def test_a_batch_of_prompts_with_n_has_vllms_shape(
    real_vllm: RealVllm, sim: Proc, stream: bool
) -> None:
    prompts = ["The knee of", "every curve is where latency bends"]
    asked = {"max_tokens": 2, "ignore_eos": True, "seed": 3}
    shapes = []
    for url in servers(real_vllm, sim):
        answer = post(
            url, real_vllm.model, "/v1/completions", prompt=prompts, n=2, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}), **asked,
        )  # fmt: skip
        alone = [
            usage_of(post(url, real_vllm.model, "/v1/completions", prompt=p, **asked), False)
            for p in prompts
        ]
        prompt_tokens = sum(u["prompt_tokens"] for u in alone)  # each prompt once
        assert usage_of(answer, stream) == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 8,
            "total_tokens": prompt_tokens + 8,
        }
        if stream:
            shape = stream_shape(answer, chat=False)
            shapes.append((sorted(per_choice(shape).items()), shape[-2:]))
        else:
            body = answer.json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
            shapes.append((keys(body), [keys(c) for c in body["choices"]]))
    real, simulated = shapes
    assert simulated == real


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": ["a", 1]},
        {"prompt": [[1], "a"]},
        {"prompt": [["a"]]},
        {"prompt": ["a", ""]},
        {"prompt": []},
        {"prompt": "a", "n": 16385},
        {"prompt": "a", "n": 2, "temperature": 0},
    ],
    ids=["str-int", "ids-str", "nested-str", "empty-item", "no-prompt", "n-limit", "n-greedy"],
)
def test_a_batch_is_refused_in_vllms_words(
    real_vllm: RealVllm, sim: Proc, fields: dict[str, Any]
) -> None:
    answers = [
        post(url, real_vllm.model, "/v1/completions", max_tokens=2, **fields)
        for url in servers(real_vllm, sim)
    ]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[1].json() == answers[0].json()


def test_an_empty_prompt_in_a_streamed_batch_is_an_error_event(
    real_vllm: RealVllm, sim: Proc
) -> None:
    bodies = [
        post(url, real_vllm.model, "/v1/completions", prompt=["a", ""], max_tokens=2, stream=True)
        for url in servers(real_vllm, sim)
    ]
    assert [b.status_code for b in bodies] == [200, 200]
    assert bodies[1].text == bodies[0].text
