"""Several sequences in one request, as vLLM 0.32 serves them: ``n`` > 1 and a list of
prompts on ``/v1/completions`` (before: both refused 400 by the simulator).

vLLM's numbering (``serving_completion.py``/``serving_chat.py``): choice index is
``prompt * n + copy``; every streamed chunk carries one choice; a chat stream opens with
one role chunk per choice; each choice ends with its own finishing chunk; the usage
counts each prompt once and every sequence's output.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.sim.base import GenerationRequest
from backends.sim.sequence import draw_output_length
from tests.procs import MODEL, Gateway, Proc, backend, served, start_gateway, start_sim, wait_until
from tests.test_proxy_wire import metric_sum, openai_client, record_of

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CONTEXT = 40_960  # the fixed-latency engine's max_model_len
PROFILE = "qwen3-4b/l40s/bf16/vllm"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
USAGE = {"include_usage": True}


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim_multi")


@pytest.fixture(scope="module")
def sim(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_sim(module_tmp, ttft_ms=1, itl_ms=1))


def post(proc: Proc, path: str, **fields: Any) -> httpx.Response:
    return httpx.post(proc.url + path, json={"model": MODEL, **fields}, timeout=30)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    datas = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]" and "[DONE]" not in datas[:-1]
    return [json.loads(d) for d in datas[:-1]]


def by_choice(chunks: list[dict[str, Any]], chat: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text, finish reasons and content chunks, from a stream's chunks."""
    seen: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if not chunk["choices"]:
            continue
        assert len(chunk["choices"]) == 1  # vLLM: one choice per chunk
        choice = chunk["choices"][0]
        mine = seen.setdefault(choice["index"], {"text": "", "finishes": [], "tokens": 0})
        text = choice["delta"].get("content", "") if chat else choice["text"]
        if text:
            mine["tokens"] += 1
        mine["text"] += text
        if choice["finish_reason"] is not None:
            mine["finishes"].append(choice["finish_reason"])
    return seen


# --- streaming --------------------------------------------------------------------


def test_a_streamed_chat_with_n_answers_each_choice_as_vllm_does(sim: Proc) -> None:
    asked = {"messages": HI, "max_tokens": 4, "seed": 5, "stream": True, "stream_options": USAGE}
    chunks = events(post(sim, CHAT, n=3, **asked))
    # One role chunk per choice, in index order, before any content.
    roles = [c["choices"][0] for c in chunks[:3]]
    assert [r["index"] for r in roles] == [0, 1, 2]
    assert all(r["delta"] == {"role": "assistant", "content": ""} for r in roles)
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[3:-1])
    choices = by_choice(chunks, chat=True)
    assert sorted(choices) == [0, 1, 2]
    assert all(c["tokens"] == 4 and c["finishes"] == ["length"] for c in choices.values())
    # Each copy is its own sequence: its own text; copy 0 is what n=1 answers.
    texts = [choices[i]["text"] for i in range(3)]
    assert len(set(texts)) == 3
    alone = by_choice(events(post(sim, CHAT, n=1, **asked)), chat=True)
    assert texts[0] == alone[0]["text"]
    # The usage chunk comes last: the prompt once, every copy's output.
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    single = post(sim, CHAT, messages=HI, max_tokens=4).json()["usage"]["prompt_tokens"]
    assert usage["usage"] == {
        "prompt_tokens": single,
        "total_tokens": single + 12,
        "completion_tokens": 12,
    }


def test_a_streamed_batch_of_prompts_numbers_choices_prompt_times_n_plus_copy(sim: Proc) -> None:
    prompts = ["one", "two and a half", "three words here"]
    chunks = events(
        post(
            sim,
            COMPLETIONS,
            prompt=prompts,
            n=2,
            max_tokens=3,
            seed=9,
            stream=True,
            stream_options=USAGE,
        )
    )
    assert all(c["object"] == "text_completion" for c in chunks)
    choices = by_choice(chunks, chat=False)
    assert sorted(choices) == list(range(6))
    assert all(c["tokens"] == 3 and c["finishes"] == ["length"] for c in choices.values())
    assert len({c["text"] for c in choices.values()}) > 1
    alone = [post(sim, COMPLETIONS, prompt=p, max_tokens=1).json()["usage"] for p in prompts]
    prompt_tokens = sum(u["prompt_tokens"] for u in alone)  # each prompt once, not n times
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 18,
        "completion_tokens": 18,
    }


def test_the_whole_answer_lists_choices_in_index_order_with_the_streamed_texts(
    sim: Proc,
) -> None:
    asked = {"prompt": ["a", "bb"], "n": 2, "max_tokens": 5, "seed": 21}
    whole = post(sim, COMPLETIONS, **asked)
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    streamed = by_choice(events(post(sim, COMPLETIONS, stream=True, **asked)), chat=False)
    assert [c["text"] for c in body["choices"]] == [streamed[i]["text"] for i in range(4)]
    assert body["usage"]["completion_tokens"] == 20
    chat = post(sim, CHAT, messages=HI, n=2, max_tokens=3, seed=21).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
    assert chat["usage"]["completion_tokens"] == 6


def test_the_openai_client_reads_every_choice(sim: Proc) -> None:
    client = openai_client(sim.url)
    reply = client.completions.create(model=MODEL, prompt=["x", "y", "z"], max_tokens=2, n=2)
    assert [c.index for c in reply.choices] == list(range(6))
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]


# --- each sequence its own: EOS draw, context -----------------------------------------


def test_each_copy_draws_its_own_end_deterministically(module_tmp: Path) -> None:
    """The calibrated engine draws an EOS per sequence: seeded by the request's seed plus
    the choice index, so copies end apart, the same way every time."""

    def natural(seed: int) -> int:  # the EOS draw of the sim's engine (--seed 0)
        return draw_output_length(GenerationRequest("r", 8, 4096, seed=seed), 0)[0]

    seed = next(s for s in range(1, 10_000) if all(natural(s + i) < 60 for i in range(3)))
    want = [natural(seed + i) for i in range(3)]
    assert len(set(want)) > 1
    proc = start_sim(module_tmp, profile=PROFILE, speed=50)
    try:
        asked = {"messages": HI, "n": 3, "max_tokens": 4096, "seed": seed, "stream": True}
        for _ in range(2):
            choices = by_choice(events(post(proc, CHAT, **asked)), chat=True)
            assert [choices[i]["tokens"] for i in range(3)] == want
            assert all(choices[i]["finishes"] == ["stop"] for i in range(3))
    finally:
        proc.stop()


def test_each_prompt_is_capped_by_what_the_context_leaves_it(sim: Proc) -> None:
    long = [7] * (CONTEXT - 2)
    body = post(sim, COMPLETIONS, prompt=[long, [7]], max_tokens=5).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 + 5
    assert body["usage"]["prompt_tokens"] == CONTEXT - 1


def test_identical_seeded_requests_at_once_are_each_served(module_tmp: Path) -> None:
    """A seeded request's id is fixed by its body; the calibrated engine refused the second
    of two alike in flight ("duplicate request id", 400), single or several sequences."""
    proc = start_sim(module_tmp, profile=PROFILE, speed=5)
    try:
        bodies = [
            {"messages": HI, "max_tokens": 200, "ignore_eos": True, "seed": 7},
            {"messages": HI, "max_tokens": 200, "ignore_eos": True, "seed": 7, "n": 2},
        ]
        for body in bodies:
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda b: post(proc, CHAT, **b), [body, body]))
            assert [a.status_code for a in answers] == [200, 200], [a.text[:200] for a in answers]
            assert answers[0].json() == answers[1].json()
    finally:
        proc.stop()


# --- a client that leaves ---------------------------------------------------------


def _request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % path.encode()
    return head + b"content-length: %d\r\n\r\n%s" % (len(data), data)


def running(proc: Proc) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "engine", [{"ttft_ms": 1, "itl_ms": 50}, {"profile": PROFILE}], ids=["fixed", "profile"]
)
def test_a_client_leaving_frees_every_sequence(
    module_tmp: Path, stream: bool, engine: dict[str, Any]
) -> None:
    slow = start_sim(module_tmp, **engine)
    try:
        body = {"model": MODEL, "prompt": ["a", "b"], "n": 3, "max_tokens": 4000, "stream": stream}
        body["ignore_eos"] = True
        if stream:
            with httpx.stream("POST", slow.url + COMPLETIONS, json=body, timeout=30) as response:
                lines = response.iter_lines()  # held: dropping it closes the connection
                next(lines)  # the first chunk: every sequence runs
                assert running(slow) == 6
        else:
            # The answer comes only once every sequence is done: the client leaves when all
            # six run, however long the engine took to start them.
            port = int(slow.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(_request(COMPLETIONS, body))
                wait_until(lambda: running(slow) == 6, timeout=30)
        wait_until(lambda: running(slow) == 0, timeout=5)
    finally:
        slow.stop()


# --- refusals ---------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_prompt_of_the_batch_over_the_context_is_refused_by_its_length(sim: Proc) -> None:
    refused = error_of(post(sim, COMPLETIONS, prompt=[[7], [7] * (CONTEXT + 3)], max_tokens=1))
    assert refused["param"] == "input_tokens"
    assert f"your prompt contains {CONTEXT + 3} input tokens" in refused["message"]
    # Every prompt is checked against the context before any is sampled.
    filled = error_of(post(sim, COMPLETIONS, prompt=[[7], [7] * CONTEXT], max_tokens=1))
    assert (
        filled["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )


def _err(kind: str, loc: str, given: str) -> str:
    says = {
        "int_parsing": "Input should be a valid integer, unable to parse string as an integer",
        "int_type": "Input should be a valid integer",
        "int_from_float": "Input should be a valid integer, got a number with a fractional part",
        "list_type": "Input should be a valid list",
        "string_type": "Input should be a valid string",
    }[kind]
    return f"{{'type': '{kind}', 'loc': 'body.{loc}', 'msg': '{says}', 'input': '{given}'}}"


# Recorded from vLLM 0.32 (tests/real_engine's CPU build) on the same bodies: pydantic
# reports each branch of ``list[int] | list[list[int]] | str | list[str]`` that fails.
MIXED_LISTS = [
    (
        ["a", 1],
        [
            _err("int_parsing", "prompt.0", "a"),
            _err("list_type", "prompt.0", "a"),
            _err("list_type", "prompt.1", "1"),
            _err("string_type", "prompt", "<list of 2 items>"),
            _err("string_type", "prompt.1", "1"),
        ],
    ),
    (
        [[1], "a"],
        [
            _err("int_type", "prompt.0", "<list of 1 items>"),
            _err("int_parsing", "prompt.1", "a"),
            _err("list_type", "prompt.1", "a"),
            _err("string_type", "prompt", "<list of 2 items>"),
            _err("string_type", "prompt.0", "<list of 1 items>"),
        ],
    ),
    (
        [["a"]],
        [
            _err("int_type", "prompt.0", "<list of 1 items>"),
            _err("int_parsing", "prompt.0.0", "a"),
            _err("string_type", "prompt", "<list of 1 items>"),
            _err("string_type", "prompt.0", "<list of 1 items>"),
        ],
    ),
    (
        [1, 2.5],
        [
            _err("int_from_float", "prompt.1", "2.5"),
            _err("list_type", "prompt.0", "1"),
            _err("list_type", "prompt.1", "2.5"),
            _err("string_type", "prompt", "<list of 2 items>"),
            _err("string_type", "prompt.0", "1"),
            _err("string_type", "prompt.1", "2.5"),
        ],
    ),
]


@pytest.mark.parametrize(
    ("prompt", "errors"), MIXED_LISTS, ids=["str-int", "ids-str", "nested-str", "float"]
)
def test_a_list_that_mixes_kinds_is_refused_in_pydantics_words(
    sim: Proc, prompt: list[Any], errors: list[str]
) -> None:
    """Before: served (``[[1], "a"]`` as two prompts) or ``prompt: invalid: TypeError``."""
    refused = error_of(post(sim, COMPLETIONS, prompt=prompt, max_tokens=2))
    label = "error" if len(errors) == 1 else "errors"
    assert refused["message"] == f"{len(errors)} validation {label}:\n" + "\n".join(
        f"  {e}" for e in errors
    )
    assert refused["type"] == "Bad Request"
    assert refused["param"] == errors[0].split("'loc': '")[1].split("'")[0]


@pytest.mark.parametrize(("prompt", "tokens"), [(["1", 2], 2), ([1, True, "2", 3.0], 4)])
def test_a_list_pydantic_reads_as_ids_in_lax_mode_is_one_prompt(
    sim: Proc, prompt: list[Any], tokens: int
) -> None:
    answer = post(sim, COMPLETIONS, prompt=prompt, max_tokens=2)
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == [0]
    assert answer.json()["usage"]["prompt_tokens"] == tokens


@pytest.mark.parametrize("prompt", [["a", ""], [""], [[]], [[1], []]])
def test_an_empty_prompt_in_a_list_is_refused_by_the_engine(sim: Proc, prompt: list[Any]) -> None:
    """vLLM's engine refuses it, after every other check: 400, or, once a stream has begun,
    an error event and ``[DONE]``. Before: served with a prompt of 0 tokens."""
    said = "The decoder prompt cannot be empty"
    refused = error_of(post(sim, COMPLETIONS, prompt=prompt, max_tokens=2))
    assert (refused["message"], refused["type"], refused["param"]) == (
        said,
        "BadRequestError",
        None,
    )
    sampled_first = error_of(post(sim, COMPLETIONS, prompt=prompt, max_tokens=2, temperature=-1))
    assert sampled_first["param"] == "temperature"
    streamed = post(sim, COMPLETIONS, prompt=prompt, max_tokens=2, stream=True)
    assert streamed.status_code == 200
    error = {"message": said, "type": "BadRequestError", "param": None, "code": 400}
    assert streamed.text == f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"


def test_n_over_vllms_limit_is_refused_with_its_words(sim: Proc) -> None:
    refused = error_of(post(sim, CHAT, messages=HI, n=16385, max_tokens=2))
    assert refused["message"] == (
        "n must be at most 16384, got 16385. "
        "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
    )


# --- through the gateway ------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, sim: Proc) -> Iterator[Gateway]:
    gw = start_gateway(module_tmp, {"backends": [backend("s", sim.url)]})
    try:
        yield gw
    finally:
        gw.proc.stop()


def test_several_choices_pass_through_the_gateway_and_are_counted(gateway: Gateway) -> None:
    """The gateway relays every choice and counts every sequence's tokens; each sequence
    is timed on its own (one gap fewer than its tokens)."""
    client = openai_client(gateway.url)
    counted = metric_sum(gateway.url, "kneecap_completion_tokens_total")
    chat = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            n=2,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-request-id": "multi-chat"},
        )
    )
    completion = list(
        client.completions.create(
            model=MODEL,
            prompt=["one", "two", "three"],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-request-id": "multi-completion"},
        )
    )
    for request_id, chunks, indexes, tokens in (
        ("multi-chat", chat, {0, 1}, 12),
        ("multi-completion", completion, {0, 1, 2}, 12),
    ):
        assert {c.index for chunk in chunks for c in chunk.choices} == indexes
        finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert finishes == ["length"] * len(indexes)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == tokens
        record = record_of(gateway, request_id)
        assert record["status"] == "ok"
        assert (record["prompt_tokens"], record["completion_tokens"]) == (
            usage.prompt_tokens,
            tokens,
        )
        assert record["finish_reason"] == "length"
        assert record["ttft_s"] > 0
        assert record["itl_count"] == tokens - len(indexes)
    assert metric_sum(gateway.url, "kneecap_completion_tokens_total") == counted + 24
