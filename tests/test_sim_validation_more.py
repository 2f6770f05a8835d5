"""More of what vLLM 0.32 refuses and the simulator served: each answer worked out from
vLLM 0.32's request models (pydantic's errors in declaration order, ``param`` the first
one's location) and its model validators.

Before the fix the simulator answered 200 to every request here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.procs import MODEL, Proc, served, start_sim
from tests.test_sim_validation import err, pydantic_error, refusal, vllm_error

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
NOT_A_DICT = "Input should be a valid dictionary or object to extract fields from"
ENCODINGS = "'float', 'base64', 'bytes' or 'bytes_only'"
DEVELOPER = "messages.0.ChatCompletionDeveloperMessageParam"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path_factory.mktemp("sim_more"), ttft_ms=1, itl_ms=0))


def post(sim: Proc, path: str, fields: dict[str, Any]) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL}
    body |= {"messages": HI, "max_tokens": 2} if path == CHAT else {"input": "hi"}
    return httpx.post(sim.url + path, json={**body, **fields}, timeout=30)


def test_an_unknown_encoding_format_is_pydantics_literal_error(sim: Proc) -> None:
    # One error or more per branch of vLLM's union of embedding requests: text input,
    # one conversation, batched ones, each of those two in ``input``.
    wrong = (
        "{'type': 'literal_error', 'loc': 'body.encoding_format', "
        f"'msg': \"Input should be {ENCODINGS}\", 'input': 'bogus', "
        f"'ctx': {{'expected': \"{ENCODINGS}\"}}}}"
    )
    missing = err("missing", "messages", "Field required", "<dict of 3 items>")
    not_a_list = err("list_type", "input", "Input should be a valid list", "hi")
    errors = [wrong, wrong, missing, wrong, missing, wrong, missing, not_a_list, wrong, missing]
    message = "11 validation errors:\n" + "\n".join(f"  {e}" for e in errors)
    message += "\n  ...and 1 more errors"
    answer = post(sim, EMBEDDINGS, {"encoding_format": "bogus"})
    assert refusal(answer) == ("Bad Request", "body.encoding_format", message)


def test_an_unknown_encoding_format_of_a_token_list_names_the_first_error(sim: Proc) -> None:
    fields = {"input": [1, 2], "encoding_format": "floats"}
    kind, param, message = refusal(post(sim, EMBEDDINGS, fields))
    assert (kind, param) == ("Bad Request", "body.encoding_format")
    assert "'loc': 'body.encoding_format'" in message.splitlines()[1]


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_a_binary_encoding_is_refused_as_not_simulated(sim: Proc, encoding: str) -> None:
    kind, param, message = refusal(post(sim, EMBEDDINGS, {"encoding_format": encoding}))
    assert (kind, param) == ("BadRequestError", "encoding_format")
    assert "not simulated" in message


@pytest.mark.parametrize("given", [[[]], [""], "", ["hi", ""]])
def test_an_empty_input_is_the_engines_empty_prompt(sim: Proc, given: Any) -> None:
    answer = refusal(post(sim, EMBEDDINGS, {"input": given}))
    assert answer == vllm_error("The decoder prompt cannot be empty")


def test_the_embeddings_still_serve_floats_and_base64(sim: Proc) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    floats = client.embeddings.create(model=MODEL, input="hi", encoding_format="float")
    assert len(floats.data[0].embedding) == 16
    encoded = client.embeddings.create(model=MODEL, input=["a", "b"])  # base64 by default
    assert [d.index for d in encoded.data] == [0, 1]


@pytest.mark.parametrize(
    ("fields", "errors"),
    [
        (
            {"tools": "notalist"},
            [err("list_type", "tools", "Input should be a valid list", "notalist")],
        ),
        ({"tools": 5}, [err("list_type", "tools", "Input should be a valid list", "5")]),
        (
            {"tools": {"a": 1}},
            [err("list_type", "tools", "Input should be a valid list", "<dict of 1 items>")],
        ),
        (
            {"tools": [5, TOOL, {}, {"function": 3}, {"function": {}}]},
            [
                err("model_attributes_type", "tools.0", NOT_A_DICT, "5"),
                err("missing", "tools.2.function", "Field required", "<dict of 0 items>"),
                err("model_attributes_type", "tools.3.function", NOT_A_DICT, "3"),
                err("missing", "tools.4.function.name", "Field required", "<dict of 0 items>"),
            ],
        ),
        # declaration order: model, then max_tokens, then tools
        (
            {"model": 0, "max_tokens": "x", "tools": 5},
            [
                err("string_type", "model", "Input should be a valid string", "0"),
                err(
                    "int_parsing",
                    "max_tokens",
                    "Input should be a valid integer, unable to parse string as an integer",
                    "x",
                ),
                err("list_type", "tools", "Input should be a valid list", "5"),
            ],
        ),
        (
            {"model": []},
            [err("string_type", "model", "Input should be a valid string", "<list of 0 items>")],
        ),
        (
            {"model": {}},
            [err("string_type", "model", "Input should be a valid string", "<dict of 0 items>")],
        ),
    ],
)
def test_tools_and_model_are_read_as_pydantic_reads_them(
    sim: Proc, fields: dict[str, Any], errors: list[str]
) -> None:
    assert refusal(post(sim, CHAT, fields)) == pydantic_error(*errors)


def test_a_completions_model_is_read_before_its_prompt(sim: Proc) -> None:
    body = {"model": 0, "prompt": [1, "a"], "max_tokens": "x"}
    response = httpx.post(sim.url + "/v1/completions", json=body, timeout=30)
    _, param, message = refusal(response)
    locs = [line.split("'loc': '")[1].split("'")[0] for line in message.splitlines()[1:]]
    assert param == "body.model"
    assert locs[0] == "body.model" and locs[1].startswith("body.prompt")
    assert locs[-1] == "body.max_tokens"


def test_a_completions_model_must_be_a_string(sim: Proc) -> None:
    response = httpx.post(
        sim.url + "/v1/completions", json={"model": 0, "prompt": "hi"}, timeout=30
    )
    assert refusal(response) == pydantic_error(
        err("string_type", "model", "Input should be a valid string", "0")
    )


@pytest.mark.parametrize(
    ("message", "kind", "loc"),
    [
        ({"content": "hi"}, "missing", f"{DEVELOPER}.role"),
        ({"role": 5, "content": "hi"}, "literal_error", f"{DEVELOPER}.role"),
        ({"role": "user", "content": 5}, "string_type", f"{DEVELOPER}.content"),
        (5, "dict_type", DEVELOPER),
    ],
)
def test_a_message_no_branch_reads_is_refused_at_vllms_first_error(
    sim: Proc, message: Any, kind: str, loc: str
) -> None:
    error_type, param, said = refusal(post(sim, CHAT, {"messages": [message]}))
    assert (error_type, param) == ("Bad Request", f"body.{loc}")
    assert f"'type': '{kind}', 'loc': 'body.{loc}'" in said


def test_an_unknown_response_format_type_is_refused(sim: Proc) -> None:
    literal = "Input should be 'text', 'json_object' or 'json_schema'"
    expected = "{'expected': \"'text', 'json_object' or 'json_schema'\"}"
    kind, param, message = refusal(post(sim, CHAT, {"response_format": {"type": "bogus"}}))
    assert (kind, param) == ("Bad Request", "body.response_format.type")
    assert message.splitlines()[0] == "6 validation errors:"
    assert f"'msg': \"{literal}\", 'input': 'bogus', 'ctx': {expected}" in message.splitlines()[1]


@pytest.mark.parametrize(
    ("fields", "answer"),
    [
        (
            {"tool_choice": "auto"},
            vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice"),
        ),
        (
            {"tool_choice": "required"},
            vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice"),
        ),
        (
            {"tools": []},
            vllm_error(
                "`tools` must not be an empty array. "
                "Either provide at least one tool or omit the field entirely.",
                "tools",
            ),
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            vllm_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            ),
        ),
    ],
)
def test_tool_choice_is_checked_as_vllm_checks_it(
    sim: Proc, fields: dict[str, Any], answer: tuple
) -> None:
    assert refusal(post(sim, CHAT, fields)) == answer


def test_a_json_schema_format_needs_its_schema(sim: Proc) -> None:
    fields = {"response_format": {"type": "json_schema"}, "tool_choice": "none"}
    said = "When response_format type is 'json_schema', the 'json_schema' field must be provided."
    assert refusal(post(sim, CHAT, fields)) == vllm_error(said, "response_format")
    served = post(sim, CHAT, {"response_format": {"type": "json_object"}})
    assert served.status_code == 200, served.text


def test_tools_vllm_accepts_are_still_served(sim: Proc) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    for choice in ("none", "auto", {"type": "function", "function": {"name": "f"}}):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=2,
            tools=[TOOL],
            tool_choice=choice,  # type: ignore[arg-type]
        )
        assert reply.choices[0].finish_reason is not None
    reply = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, tool_choice="none"
    )
    assert reply.usage is not None
