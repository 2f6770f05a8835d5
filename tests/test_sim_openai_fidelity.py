"""The simulated backend answers the OpenAI surface as vLLM 0.32 does, beyond the tokens:
embeddings (a lone surrogate, the context, chat input, base64), ``echo``, logprobs,
continuous usage stats, a request without ``model``, the model card, unknown routes and
``/version``. Each case was a divergence hunter-sim found against vLLM 0.32's source
(``entrypoints/openai/*/serving.py``, ``entrypoints/pooling/``, ``renderers/params.py``).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.procs import MODEL, Proc, free_port, served, start_process, start_sim

CONTEXT = 40_960  # the fixed-latency engine's max_model_len
SURROGATE = b'{"model":"%s","input":"\\ud800"}' % MODEL.encode()
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp: Path = tmp_path_factory.mktemp("sim_openai")
    yield from served(start_sim(tmp, ttft_ms=1, itl_ms=0))


def client(proc: Proc) -> OpenAI:
    return OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)


def events(proc: Proc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", proc.url + path, json={"model": MODEL, **body}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


# -- embeddings -----------------------------------------------------------------------


def test_embedding_of_a_lone_surrogate_is_a_400(sim: Proc) -> None:
    answer = httpx.post(
        sim.url + "/v1/embeddings",
        content=SURROGATE,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "input"
    assert httpx.get(sim.url + "/health", timeout=5).status_code == 200


def test_surrogate_embeddings_do_not_eject_the_embedded_replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Each was a 500 from the replica; three of them ejected every embedded one."""
    port = free_port()
    log = tmp_path_factory.mktemp("gw_embed") / "gw.log"
    args = ["serve", "--port", str(port), "--log-level", "warning"]
    for gateway in served(start_process(args, f"http://127.0.0.1:{port}", "/ready", log)):
        for _ in range(3):
            refused = httpx.post(
                gateway.url + "/v1/embeddings",
                content=SURROGATE,
                headers={"content-type": "application/json"},
                timeout=30,
            )
            assert refused.status_code == 400, refused.text
        answer = client(gateway).chat.completions.with_raw_response.create(
            model=MODEL, messages=HI, max_tokens=2
        )
        assert answer.http_response.status_code == 200


@pytest.mark.parametrize(
    "item", ["abcd" * (CONTEXT + 1), [1] * (CONTEXT + 1)], ids=["text", "token_ids"]
)
def test_embedding_over_the_context_is_refused(sim: Proc, item: object) -> None:
    with pytest.raises(BadRequestError) as refused:
        client(sim).embeddings.create(model=MODEL, input=item)  # type: ignore[arg-type]
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["message"].startswith("This model's maximum context length is 40960 tokens.")
    assert error["param"] == "input_tokens"
    fits = client(sim).embeddings.create(model=MODEL, input="abcd" * CONTEXT)
    assert fits.usage.prompt_tokens == CONTEXT


def test_chat_embeddings_are_counted_as_chat(sim: Proc) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    answer = httpx.post(sim.url + "/v1/embeddings", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    # one message of 2 tokens, and no assistant turn: embeddings add no generation prompt
    assert answer.json()["usage"]["prompt_tokens"] == 4 + 2
    assert len(answer.json()["data"]) == 1


def test_base64_embeddings_are_little_endian_float32(sim: Proc) -> None:
    floats = client(sim).embeddings.create(model=MODEL, input="hello", encoding_format="float")
    raw = httpx.post(
        sim.url + "/v1/embeddings",
        json={"model": MODEL, "input": "hello", "encoding_format": "base64"},
        timeout=30,
    ).json()["data"][0]["embedding"]
    assert isinstance(raw, str)
    decoded = struct.unpack(f"<{len(raw) * 3 // 4 // 4}f", base64.b64decode(raw))
    assert decoded == pytest.approx(floats.data[0].embedding, rel=1e-6)


# -- echo -----------------------------------------------------------------------------


def test_echo_prepends_the_prompt(sim: Proc) -> None:
    plain = client(sim).completions.create(model=MODEL, prompt="hello there", max_tokens=3, seed=7)
    echoed = client(sim).completions.create(
        model=MODEL, prompt="hello there", max_tokens=3, seed=7, echo=True
    )
    assert echoed.choices[0].text == "hello there" + plain.choices[0].text


def test_echo_streams_the_prompt_in_the_first_chunk(sim: Proc) -> None:
    body = {"prompt": "hello there", "max_tokens": 3, "seed": 7, "stream": True}
    plain = [e["choices"][0]["text"] for e in events(sim, "/v1/completions", body)]
    echoed = [
        e["choices"][0]["text"] for e in events(sim, "/v1/completions", {**body, "echo": True})
    ]
    assert echoed == ["hello there" + plain[0], *plain[1:]]


def test_echo_of_several_prompts(sim: Proc) -> None:
    answer = client(sim).completions.create(
        model=MODEL, prompt=["ab", "cd"], max_tokens=2, seed=7, echo=True
    )
    assert [c.text[:2] for c in answer.choices] == ["ab", "cd"]


# -- logprobs -------------------------------------------------------------------------


def test_chat_logprobs_in_vllms_shape(sim: Proc) -> None:
    asked = {"model": MODEL, "messages": HI, "max_tokens": 4, "seed": 5}
    answer = client(sim).chat.completions.create(**asked, logprobs=True, top_logprobs=3)
    again = client(sim).chat.completions.create(**asked, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert answer.usage is not None and len(content) == answer.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # the sampled token, first
        ranked = [top.logprob for top in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
    assert again.choices[0].logprobs == choice.logprobs  # deterministic under a seed


def test_completion_logprobs_in_vllms_shape(sim: Proc) -> None:
    answer = client(sim).completions.create(
        model=MODEL, prompt="hi", max_tokens=4, seed=5, logprobs=2
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert answer.usage is not None and len(logprobs.tokens) == answer.usage.completion_tokens
    assert "".join(logprobs.tokens) == answer.choices[0].text
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    assert logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top is not None and len(top) == 2 and top[token] == logprob


def test_streamed_logprobs_match_the_whole_answer(sim: Proc) -> None:
    body = {"messages": HI, "max_tokens": 5, "seed": 9, "logprobs": True, "top_logprobs": 1}
    whole = httpx.post(
        sim.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=30
    ).json()["choices"][0]["logprobs"]["content"]
    streamed = events(sim, "/v1/chat/completions", {**body, "stream": True})
    tokens = [e for e in streamed if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert [e["choices"][0]["logprobs"]["content"][0] for e in tokens] == whole

    body = {"prompt": "hi", "max_tokens": 5, "seed": 9, "logprobs": 0}
    whole = httpx.post(
        sim.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30
    ).json()["choices"][0]["logprobs"]
    streamed = events(sim, "/v1/completions", {**body, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in streamed if e["choices"]]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        assert [x for part in parts for x in part[key]] == whole[key]


def test_echo_with_logprobs_lists_the_prompt_first(sim: Proc) -> None:
    """As vLLM does (its prompt logprobs, then the output's): the prompt's tokens, under
    the simulator's rule of 4 bytes a token, the first without a logprob."""
    body = {"prompt": "hello there", "max_tokens": 3, "seed": 4, "logprobs": 1, "echo": True}
    whole = httpx.post(
        sim.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30
    ).json()["choices"][0]
    logprobs = whole["logprobs"]
    assert logprobs["tokens"][:3] == ["hell", "o th", "ere"]
    assert "".join(logprobs["tokens"]) == whole["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"][:4] == [0, 4, 8, 11]

    streamed = events(sim, "/v1/completions", {**body, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in streamed if e["choices"]]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        assert [x for part in parts for x in part[key]] == logprobs[key]


def test_logprobs_of_several_choices(sim: Proc) -> None:
    answer = client(sim).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, seed=2, n=2, logprobs=True
    )
    for choice in answer.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert "".join(e.token for e in choice.logprobs.content) == choice.message.content


# -- streams, model, routes -----------------------------------------------------------


def test_continuous_usage_stats_on_every_chunk(sim: Proc) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": HI, "max_tokens": 3, "stream": True, "stream_options": options}
    chunks = events(sim, "/v1/chat/completions", body)
    usages = [e["usage"] for e in chunks]
    assert [u["completion_tokens"] for u in usages] == [0, 1, 2, 3, 3]
    assert {u["prompt_tokens"] for u in usages} == {8}


def test_a_request_without_model_is_served(sim: Proc) -> None:
    answer = httpx.post(
        sim.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL


def test_model_card_like_vllms(sim: Proc) -> None:
    card = client(sim).models.list().data[0]
    assert card.id == MODEL and card.created > 0
    extra = card.model_dump()
    assert extra["root"] == MODEL and extra["parent"] is None
    assert extra["max_model_len"] == CONTEXT


def test_unknown_routes_answer_json_as_fastapi_does(sim: Proc) -> None:
    missing = httpx.get(sim.url + "/v1/nothing", timeout=5)
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    wrong = httpx.get(sim.url + "/v1/completions", timeout=5)
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})
    assert httpx.get(sim.url + "/version", timeout=5).json() == {"version": "0.32.0"}


@pytest.mark.parametrize(
    ("path", "body", "asked"),
    [
        ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, 21),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 151_936),
    ],
    ids=["chat", "completions_all"],
)
def test_logprobs_past_vllms_max_are_refused(
    sim: Proc, path: str, body: dict[str, Any], asked: int
) -> None:
    said = f"Requested sample logprobs of {asked}, which is greater than max allowed: 20"
    answer = httpx.post(sim.url + path, json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["message"], error["param"]) == (
        f"{said} (parameter=logprobs, value={asked})",
        "logprobs",
    )
    # The engine refuses it: a stream has begun, and ends in the error.
    with httpx.stream(
        "POST", sim.url + path, json={"model": MODEL, **body, "stream": True}, timeout=30
    ) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line]
    assert json.loads(lines[0][6:])["error"]["message"].startswith(said)
    assert lines[-1] == "data: [DONE]"
