"""The simulator counts what vLLM's chat template renders besides the messages' text: the
tool definitions and the assistant messages' tool calls. Uncounted, a tool-heavy prompt
was a few tokens in usage, prefill and the context check, and the gateway, which learns
its characters per token from usage, learned a skewed ratio and sent long prompts to the
short pool (hunter-sim's finding)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from backends.sim.tokenizer import CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_REPLY, text_of_tokens
from tests.procs import MODEL, Proc, free_port, served, start_process, start_sim

CONTEXT = 40_960  # the fixed-latency engine's max_model_len
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"f{i}",
            "description": "lorem ipsum dolor " * 100,
            "parameters": {"type": "object", "properties": {}},
        },
    }
    for i in range(20)
]
USER = [{"role": "user", "content": "hi"}]
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f0", "arguments": json.dumps({"city": "Paris" * 50})},
    }
]


def tokens_of_json(value: Any) -> int:
    return -(-len(json.dumps(value, ensure_ascii=False).encode()) // 4)


# "hi": one token, in one message, and the assistant's turn.
BARE = CHAT_TOKENS_PER_REPLY + CHAT_TOKENS_PER_MESSAGE + 1


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("sim_tools")
    yield from served(start_sim(tmp, ttft_ms=1, itl_ms=0))


def client(proc: Proc) -> OpenAI:
    return OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)


def test_tool_definitions_count_in_usage(sim: Proc) -> None:
    answer = client(sim).chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=1
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == BARE + tokens_of_json(TOOLS)  # 9,563


def test_assistant_tool_calls_count_in_usage(sim: Proc) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = client(sim).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert answer.usage is not None
    # three messages: "hi", the call (no text), "sunny" (2 tokens)
    expected = CHAT_TOKENS_PER_REPLY + 3 * CHAT_TOKENS_PER_MESSAGE + 1 + 2 + tokens_of_json(CALLS)
    assert answer.usage.prompt_tokens == expected


def test_tokenize_counts_the_tools(sim: Proc) -> None:
    body = {"model": MODEL, "messages": USER, "tools": TOOLS}
    counted = httpx.post(sim.url + "/tokenize", json=body, timeout=30).json()
    assert counted["count"] == BARE + tokens_of_json(TOOLS)


def test_tools_count_against_the_context(sim: Proc) -> None:
    """Messages that fit alone, tools that push them over: vLLM's context 400."""
    room = CONTEXT - BARE - tokens_of_json(TOOLS)
    messages = [{"role": "user", "content": "hi" + text_of_tokens(room + 10)}]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 1}
    answer = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "input_tokens"
    alone = httpx.post(sim.url + "/v1/chat/completions", json={**body, "tools": None}, timeout=30)
    assert alone.status_code == 200, alone.text


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """``kneecap serve`` with no config: its simulated replicas, its calibration."""
    tmp: Path = tmp_path_factory.mktemp("gw_tools")
    port = free_port()
    args = ["serve", "--port", str(port), "--log-level", "warning"]
    yield from served(start_process(args, f"http://127.0.0.1:{port}", "/ready", tmp / "gw.log"))


def test_tool_traffic_does_not_misroute_a_long_prompt(embedded: Proc) -> None:
    long_prompt = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": text_of_tokens(10_000)}],
    }

    def backend() -> str:
        answer = httpx.post(embedded.url + "/v1/chat/completions", json=long_prompt, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-kneecap-backend"]

    assert backend() == "sim-long-0"  # 10,007 tokens: the long pool
    with_tools = {
        "model": MODEL,
        "max_tokens": 1,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "hello world, how are you? " * 10}],
    }
    for _ in range(10):
        answer = httpx.post(embedded.url + "/v1/chat/completions", json=with_tools, timeout=60)
        assert answer.status_code == 200, answer.text
    calibration = httpx.get(embedded.url + "/admin/state").json()["routing"]["calibration"]
    assert backend() == "sim-long-0", calibration
