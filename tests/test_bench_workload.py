"""Prompt mixes, replayed requests, request bodies and prompt-length fitting."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from backends.sim.tokenizer import count_chat_tokens, count_text_tokens
from gateway.bench.prompts import ENDPOINTS, BodyOptions, PromptText, build_body, fit_prompts
from gateway.bench.workload import (
    PromptMix,
    SyntheticWorkload,
    WorkloadError,
    load_requests_file,
    parse_prompt_tokens,
)


def test_lengths_without_weights_are_separate_series() -> None:
    assert parse_prompt_tokens("1024, 8192,32768") == [
        PromptMix((1024,), (1.0,)),
        PromptMix((8192,), (1.0,)),
        PromptMix((32768,), (1.0,)),
    ]


def test_weighted_mix_is_one_series_drawn_in_proportion() -> None:
    [mix] = parse_prompt_tokens("1024:0.8,8192:0.15,32768:0.05")
    assert mix.label == "1024:0.8,8192:0.15,32768:0.05"
    workload = SyntheticWorkload(mix, 16, seed=3)
    draws = [workload.spec(i).prompt_tokens for i in range(4000)]
    assert draws.count(1024) / 4000 == pytest.approx(0.8, abs=0.03)
    assert draws.count(32768) / 4000 == pytest.approx(0.05, abs=0.015)
    assert [workload.spec(i) for i in range(5)] == [workload.spec(i) for i in range(5)]
    assert mix.draw(random.Random(0)) in (1024, 8192, 32768)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("1024:0.5,8192", "weights for every length"),
        ("abc", "bad prompt length"),
        ("0", "tokens >= 1"),
        ("10:0,20:0", "sum to zero"),
    ],
)
def test_bad_prompt_specs(text: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=fragment):
        parse_prompt_tokens(text)


@pytest.mark.parametrize(
    ("endpoint", "target"), [("chat", 1024), ("completions", 1024), ("chat", 11)]
)
def test_synthetic_prompts_have_exact_counts_under_the_sim_rule(endpoint: str, target: int) -> None:
    spec = SyntheticWorkload(PromptMix((target,), (1.0,)), 7).spec(12)
    path, body = build_body(
        spec, PromptText(ENDPOINTS[endpoint]), BodyOptions("m", ENDPOINTS[endpoint])
    )
    counted = (
        count_chat_tokens(body["messages"])
        if endpoint == "chat"
        else count_text_tokens(body["prompt"])
    )
    assert counted == target
    assert path == ENDPOINTS[endpoint].path
    assert body["stream"] is True and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_prompts_differ_per_request_and_per_run() -> None:
    chat = ENDPOINTS["chat"]
    run_a, run_b = PromptText(chat, nonce=1), PromptText(chat, nonce=2)
    assert run_a.text(64, 0, 0)[:16] != run_a.text(64, 1, 0)[:16]
    assert run_a.text(64, 0, 0)[:16] != run_b.text(64, 0, 0)[:16]
    assert count_text_tokens(run_a.text(64, 5, 0)) == count_text_tokens(run_b.text(64, 5, 0))


def test_fit_prompts_converges_on_a_different_tokenizer() -> None:
    prompts = PromptText(ENDPOINTS["completions"])

    async def count(part: dict[str, Any]) -> int:  # a tokenizer with ~3 bytes per token
        return 5 + len(part["prompt"].encode()) // 3

    notes = anyio.run(fit_prompts, prompts, [1024, 300], count)
    assert notes == [
        "300-token prompts: /tokenize counts 300",
        "1024-token prompts: /tokenize counts 1024",
    ]

    async def check() -> int:
        return await count({"prompt": prompts.text(1024, 0, 0)})

    assert anyio.run(check) == 1024


def test_fit_prompts_without_tokenize_estimates() -> None:
    async def none(part: dict[str, Any]) -> None:
        return None

    notes = anyio.run(fit_prompts, PromptText(ENDPOINTS["chat"]), [64], none)
    assert notes == ["prompt token counts estimated (the target has no /tokenize)"]


def test_replayed_requests(tmp_path: Path) -> None:
    path = tmp_path / "reqs.jsonl"
    lines = [
        {"model": "other", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 9},
        {"prompt": "y" * 40, "max_completion_tokens": 3},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    workload = load_requests_file(path, output_tokens=100)
    first, second, third = (workload.spec(i) for i in range(3))
    assert (first.prompt_tokens, first.max_tokens) == (107, 9)
    assert (second.prompt_tokens, second.max_tokens) == (10, 3)
    assert third.body == first.body  # cycled
    path_, body = build_body(
        second, PromptText(ENDPOINTS["chat"]), BodyOptions("m", ENDPOINTS["chat"])
    )
    assert path_ == "/completions" and body["prompt"] == "y" * 40 and body["model"] == "m"
    assert "max_completion_tokens" not in body and body["max_tokens"] == 3


def test_a_replayed_chat_counts_its_tools_as_the_engine_does(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"q": "s" * 80}}}]
    messages = [{"role": "user", "content": "x" * 400}]
    path = tmp_path / "reqs.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    spec = load_requests_file(path, output_tokens=10).spec(0)
    assert spec.prompt_tokens == count_chat_tokens(messages, tools)
    assert spec.prompt_tokens > count_chat_tokens(messages)


def test_bad_requests_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        load_requests_file(path, 10)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_requests_file(tmp_path / "missing.jsonl", 10)
