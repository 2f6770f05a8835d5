"""The simulator refuses what vLLM 0.32 refuses, in vLLM's words, over HTTP.

Every expected answer here was recorded from vLLM 0.32 (the CPU build of
``tests/real_engine``) on the same request. Two families of 400:

* a sampling parameter out of range (``SamplingParams._verify_args``): type
  ``BadRequestError``; when vLLM names the parameter, ``param`` is it and the message
  ends ``(parameter=..., value=...)``.
* a field pydantic cannot read (FastAPI's ``RequestValidationError``): type
  ``Bad Request``, ``param`` the dotted location of the first error
  (``body.max_tokens``), the message every error as pydantic spells it.

Before the fix the simulator served ``temperature: -1``, ``top_p: 0`` and ``stop: 123``,
and answered a field it could not read with type ``BadRequestError`` and ``param``
``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import MODEL, Gateway, Proc, served, start_sim

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path_factory.mktemp("sim_validation"), ttft_ms=1, itl_ms=0))


def post(sim: Proc, path: str, fields: dict[str, Any]) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    if path == CHAT:
        body["messages"] = HI
    else:
        body["prompt"] = "hi"
    return httpx.post(sim.url + path, json={**body, **fields}, timeout=30)


def refusal(response: httpx.Response) -> tuple[str, str | None, str]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400
    return error["type"], error["param"], error["message"]


def vllm_error(message: str, parameter: str | None = None, value: Any = None) -> tuple:
    """What vLLM answers for a ``VLLMValidationError``: its str() names the parameter."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    extras += [f"value={value}"] if value is not None else []
    said = f"{message} ({', '.join(extras)})" if extras else message
    return "BadRequestError", parameter, said


def pydantic_error(*errors: str) -> tuple:
    """What vLLM answers when pydantic cannot read the body: ``param`` is the first
    error's location."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {e}" for e in errors)
    first = errors[0].split("'loc': '")[1].split("'")[0]
    return "Bad Request", first, message


def err(kind: str, loc: str, msg: str, given: str, ctx: str = "") -> str:
    tail = f", 'ctx': {ctx}" if ctx else ""
    return f"{{'type': '{kind}', 'loc': 'body.{loc}', 'msg': '{msg}', 'input': '{given}'{tail}}}"


NOT_AN_INT = "Input should be a valid integer, unable to parse string as an integer"
NOT_A_NUMBER = "Input should be a valid number, unable to parse string as a number"
NOT_A_BOOL = "Input should be a valid boolean, unable to interpret input"
NOT_A_STRING = "Input should be a valid string"
NOT_A_LIST = "Input should be a valid list"


# --- sampling parameters out of range: SamplingParams._verify_args -----------------

RANGES: list[tuple[dict[str, Any], tuple]] = [
    (
        {"temperature": -1},
        vllm_error("temperature must be non-negative, got -1.0.", "temperature", -1.0),
    ),
    ({"temperature": 3}, vllm_error("temperature must be in [0, 2], got 3.0.", "temperature", 3.0)),
    (
        {"temperature": "nan"},
        vllm_error("temperature must be a finite number, got nan.", "temperature", "nan"),
    ),
    ({"top_p": 0}, vllm_error("top_p must be in (0, 1], got 0.0.", "top_p", 0.0)),
    ({"top_p": 1.5}, vllm_error("top_p must be in (0, 1], got 1.5.", "top_p", 1.5)),
    ({"top_k": -2}, vllm_error("top_k must be 0 (disable), or at least 1, got -2.")),
    ({"min_p": 2}, vllm_error("min_p must be in [0, 1], got 2.0.")),
    ({"presence_penalty": 3}, vllm_error("presence_penalty must be in [-2, 2], got 3.0.")),
    ({"frequency_penalty": -3}, vllm_error("frequency_penalty must be in [-2, 2], got -3.0.")),
    (
        {"repetition_penalty": 0},
        vllm_error("repetition_penalty must be greater than zero, got 0.0."),
    ),
    (
        {"repetition_penalty": "inf"},
        vllm_error("repetition_penalty must be a finite number, got inf."),
    ),
    ({"stop": ""}, vllm_error("stop cannot contain an empty string.")),
    ({"stop": ["a", ""]}, vllm_error("stop cannot contain an empty string.")),
    ({"min_tokens": -1}, vllm_error("min_tokens must be greater than or equal to 0, got -1.")),
    (
        {"min_tokens": 10},
        vllm_error("min_tokens must be less than or equal to max_tokens=2, got 10."),
    ),
    ({"max_tokens": -1}, vllm_error("max_tokens must be at least 1, got -1.", "max_tokens", -1)),
    ({"n": 2, "temperature": 0}, vllm_error("n must be 1 when using greedy sampling, got 2.")),
    # In vLLM's order: n, the penalties, temperature, top_p, ..., max_tokens.
    ({"n": 0, "temperature": -1}, vllm_error("n must be at least 1, got 0.")),
    (
        {"presence_penalty": 3, "temperature": -1},
        vllm_error("presence_penalty must be in [-2, 2], got 3.0."),
    ),
    (
        {"temperature": -1, "top_p": 0},
        vllm_error("temperature must be non-negative, got -1.0.", "temperature", -1.0),
    ),
    (
        {"max_tokens": 0, "temperature": -1},
        vllm_error("temperature must be non-negative, got -1.0.", "temperature", -1.0),
    ),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "answer"), RANGES, ids=[str(f) for f, _ in RANGES])
def test_a_sampling_parameter_out_of_range_is_refused_as_vllm_does(
    sim: Proc, path: str, fields: dict[str, Any], answer: tuple
) -> None:
    assert refusal(post(sim, path, fields)) == answer


def test_the_context_checks_come_before_the_sampling_checks(sim: Proc) -> None:
    over = 40_960 + 1  # the simulator's context, plus one
    message = (
        f"max_tokens={over} cannot be greater than max_model_len=40960. "
        "Please request fewer output tokens."
    )
    refused = post(sim, CHAT, {"max_tokens": over, "temperature": -1})
    assert refusal(refused) == vllm_error(message, "max_tokens", over)


ACCEPTED: list[dict[str, Any]] = [
    {"top_k": -1},  # "quietly accept -1 as disabled"
    {"top_k": None},
    {"seed": -1},
    {"temperature": "0.5"},
    {"temperature": " 0.5 "},
    {"temperature": True},
    {"temperature": 1e-9},
    {"temperature": None},
    {"top_p": 1, "min_p": 0, "presence_penalty": -2, "frequency_penalty": 2},
    {"stop": None},
    {"stop": "x" * 300},
    {"stop": ["a", "b", "c", "d"]},
    {"max_tokens": True},
    {"min_tokens": 2},
    {"stream_options": None},
]


@pytest.mark.parametrize("fields", ACCEPTED, ids=[str(f)[:40] for f in ACCEPTED])
def test_what_vllm_accepts_is_still_served(sim: Proc, fields: dict[str, Any]) -> None:
    answer = post(sim, CHAT, fields)
    assert answer.status_code == 200, answer.text


def test_n_null_is_one_for_chat_but_refused_by_completions(sim: Proc) -> None:
    assert post(sim, CHAT, {"n": None}).status_code == 200
    refused = post(sim, COMPLETIONS, {"n": None})
    assert refusal(refused) == pydantic_error(
        err("int_type", "n", "Input should be a valid integer", "None")
    )


# --- fields pydantic cannot read: FastAPI's RequestValidationError ------------------

PYDANTIC: list[tuple[dict[str, Any], tuple]] = [
    ({"max_tokens": "abc"}, pydantic_error(err("int_parsing", "max_tokens", NOT_AN_INT, "abc"))),
    (
        {"max_tokens": 3.5},
        pydantic_error(
            err(
                "int_from_float",
                "max_tokens",
                "Input should be a valid integer, got a number with a fractional part",
                "3.5",
            )
        ),
    ),
    (
        {"max_tokens": [3]},
        pydantic_error(
            err("int_type", "max_tokens", "Input should be a valid integer", "<list of 1 items>")
        ),
    ),
    (
        {"max_tokens": "x" * 300},
        pydantic_error(err("int_parsing", "max_tokens", NOT_AN_INT, "x" * 200 + "...[truncated]")),
    ),
    (
        {"max_tokens": "/home/me/notes.txt"},  # vLLM hides paths from its messages
        pydantic_error(err("int_parsing", "max_tokens", NOT_AN_INT, "<path>")),
    ),
    (
        {"stop": 123},
        pydantic_error(
            err("string_type", "stop", NOT_A_STRING, "123"),
            err("list_type", "stop", NOT_A_LIST, "123"),
        ),
    ),
    (
        {"stop": ["a", 1, 2]},
        pydantic_error(
            err("string_type", "stop", NOT_A_STRING, "<list of 3 items>"),
            err("string_type", "stop.1", NOT_A_STRING, "1"),
            err("string_type", "stop.2", NOT_A_STRING, "2"),
        ),
    ),
    (
        {"stop": ["a"] * 5},
        pydantic_error(
            err("string_type", "stop", NOT_A_STRING, "<list of 5 items>"),
            err(
                "too_long",
                "stop",
                "List should have at most 4 items after validation, not 5",
                "<list of 5 items>",
                "{'field_type': 'List', 'max_length': 4, 'actual_length': 5}",
            ),
        ),
    ),
    ({"seed": "abc"}, pydantic_error(err("int_parsing", "seed", NOT_AN_INT, "abc"))),
    (
        {"seed": INT64_MAX + 1},
        pydantic_error(
            err(
                "less_than_equal",
                "seed",
                f"Input should be less than or equal to {INT64_MAX}",
                str(INT64_MAX + 1),
                f"{{'le': {INT64_MAX}}}",
            )
        ),
    ),
    (
        {"temperature": "abc"},
        pydantic_error(err("float_parsing", "temperature", NOT_A_NUMBER, "abc")),
    ),
    (
        {"temperature": [1]},
        pydantic_error(
            err("float_type", "temperature", "Input should be a valid number", "<list of 1 items>")
        ),
    ),
    (  # no float holds it (the simulator answered 500)
        {"temperature": 10**400},
        pydantic_error(
            err(
                "float_type",
                "temperature",
                "Input should be a valid number",
                "1" + "0" * 199 + "...[truncated]",
            )
        ),
    ),
    ({"top_k": "x"}, pydantic_error(err("int_parsing", "top_k", NOT_AN_INT, "x"))),
    ({"stream": "maybe"}, pydantic_error(err("bool_parsing", "stream", NOT_A_BOOL, "maybe"))),
    ({"stream": 2}, pydantic_error(err("bool_parsing", "stream", NOT_A_BOOL, "2"))),
    (
        {"stream": 0.5},
        pydantic_error(err("bool_type", "stream", "Input should be a valid boolean", "0.5")),
    ),
    (
        {"ignore_eos": None},
        pydantic_error(err("bool_type", "ignore_eos", "Input should be a valid boolean", "None")),
    ),
    (
        {"min_tokens": None},
        pydantic_error(err("int_type", "min_tokens", "Input should be a valid integer", "None")),
    ),
    (
        {"stream": True, "stream_options": {"include_usage": "maybe"}},
        pydantic_error(err("bool_parsing", "stream_options.include_usage", NOT_A_BOOL, "maybe")),
    ),
    (
        {"stream": True, "stream_options": "x"},
        pydantic_error(
            err(
                "model_attributes_type",
                "stream_options",
                "Input should be a valid dictionary or object to extract fields from",
                "x",
            )
        ),
    ),
    (  # every error, in the order the fields are declared
        {"temperature": "x", "max_tokens": "abc"},
        pydantic_error(
            err("int_parsing", "max_tokens", NOT_AN_INT, "abc"),
            err("float_parsing", "temperature", NOT_A_NUMBER, "x"),
        ),
    ),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "answer"), PYDANTIC, ids=[str(f)[:40] for f, _ in PYDANTIC])
def test_a_field_pydantic_cannot_read_is_refused_as_vllm_does(
    sim: Proc, path: str, fields: dict[str, Any], answer: tuple
) -> None:
    assert refusal(post(sim, path, fields)) == answer


def test_at_most_ten_errors_are_spelled_out(sim: Proc) -> None:
    fields = {
        "max_tokens": "abc",
        "stop": 1,
        "n": "x",
        "temperature": "t",
        "top_p": "t",
        "top_k": "t",
        "min_p": "t",
        "seed": "s",
        "presence_penalty": "p",
        "frequency_penalty": "f",
        "repetition_penalty": "r",
        "min_tokens": "m",
        "ignore_eos": "i",
        "stream": "s",
    }
    kind, param, message = refusal(post(sim, CHAT, fields))
    assert (kind, param) == ("Bad Request", "body.frequency_penalty")
    lines = message.split("\n")
    assert lines[0] == "15 validation errors:"
    assert lines[1] == "  " + err("float_parsing", "frequency_penalty", NOT_A_NUMBER, "f")
    assert lines[10] == "  " + err("float_parsing", "top_p", NOT_A_NUMBER, "t")
    assert lines[11:] == ["  ...and 5 more errors"]


def test_the_prompt_and_messages_are_read_as_pydantic_reads_them(sim: Proc) -> None:
    refused = post(sim, COMPLETIONS, {"prompt": 123})
    assert refusal(refused) == pydantic_error(
        err("list_type", "prompt", NOT_A_LIST, "123"),
        err("list_type", "prompt", NOT_A_LIST, "123"),
        err("string_type", "prompt", NOT_A_STRING, "123"),
        err("list_type", "prompt", NOT_A_LIST, "123"),
    )
    refused = post(sim, CHAT, {"messages": "hi", "max_tokens": "abc"})
    assert refusal(refused) == pydantic_error(
        err("list_type", "messages", NOT_A_LIST, "hi"),
        err("int_parsing", "max_tokens", NOT_AN_INT, "abc"),
    )
    body = {"model": MODEL, "max_tokens": 2}
    missing = httpx.post(sim.url + CHAT, json=body, timeout=30)
    assert refusal(missing) == pydantic_error(
        err("missing", "messages", "Field required", "<dict of 2 items>")
    )


BEFORE: list[tuple[str, dict[str, Any], tuple]] = [
    (
        CHAT,
        {"top_logprobs": 3, "stream_options": {"include_usage": True}},
        vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"),
    ),
    (
        CHAT,
        {"top_logprobs": "x", "max_tokens": "abc"},
        vllm_error("`top_logprobs` must be an integer.", "top_logprobs", "x"),
    ),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": -2},
        vllm_error("`top_logprobs` must be a positive value or -1.", "top_logprobs", -2),
    ),
    (
        CHAT,
        {"prompt_logprobs": 1, "stream": True},
        vllm_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"),
    ),
    (
        COMPLETIONS,
        {"logprobs": -2},
        vllm_error("`logprobs` must be a positive value or -1.", "logprobs", -2),
    ),
    (
        COMPLETIONS,
        {"logprobs": "x"},
        vllm_error("`logprobs` must be an integer.", "logprobs", "x"),
    ),
    (
        COMPLETIONS,
        {"logprobs": -2, "stream_options": {"include_usage": True}},
        vllm_error("Stream options can only be defined when `stream=True`.", "stream_options"),
    ),
    (
        COMPLETIONS,
        {"prompt": "", "stream_options": {"include_usage": True}},
        vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt"),
    ),
    # vLLM iterates the messages before pydantic reads them: its TypeError is the answer.
    (CHAT, {"messages": None}, vllm_error("'NoneType' object is not iterable")),
    (CHAT, {"messages": 123, "max_tokens": "abc"}, vllm_error("'int' object is not iterable")),
    (COMPLETIONS, {"prompt": []}, vllm_error("You must pass at least one prompt")),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": 1.5},
        pydantic_error(
            err(
                "int_from_float",
                "top_logprobs",
                "Input should be a valid integer, got a number with a fractional part",
                "1.5",
            )
        ),
    ),
    (CHAT, {"logprobs": "x"}, pydantic_error(err("bool_parsing", "logprobs", NOT_A_BOOL, "x"))),
]


@pytest.mark.parametrize(
    ("path", "fields", "answer"), BEFORE, ids=[f"{p[4:]}-{str(f)[:40]}" for p, f, _ in BEFORE]
)
def test_the_logprobs_and_the_raw_body_are_checked_as_vllm_does(
    sim: Proc, path: str, fields: dict[str, Any], answer: tuple
) -> None:
    assert refusal(post(sim, path, fields)) == answer


def test_a_text_over_the_context_is_known_to_be_at_least_one_token_over(sim: Proc) -> None:
    """vLLM tokenizes a text at most one token past the context."""
    long_text = "abcd" * 50_000  # 50,000 tokens to the simulator
    refused = post(sim, COMPLETIONS, {"prompt": long_text})
    message = (
        "This model's maximum context length is 40960 tokens. However, your prompt contains "
        "at least 40961 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt."
    )
    assert refusal(refused) == vllm_error(message, "input_tokens", 40961)


def test_a_model_validator_runs_before_the_fields_are_read(sim: Proc) -> None:
    """vLLM's ``mode="before"`` validators raise a VLLMValidationError of their own."""
    fields = {"max_tokens": "abc", "stream_options": {"include_usage": True}}
    message = "Stream options can only be defined when `stream=True`."
    assert refusal(post(sim, CHAT, fields)) == vllm_error(message, "stream_options")
    empty = post(sim, COMPLETIONS, {"prompt": "", "temperature": -1})
    message = "Either prompt or prompt_embeds must be provided and non-empty."
    assert refusal(empty) == vllm_error(message, "prompt")


# --- through the gateway --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields", [{"temperature": -1}, {"stop": 123}], ids=str)
def test_the_gateway_relays_the_simulators_refusal_unchanged(
    gateway: Gateway, sims: list[Proc], fields: dict[str, Any], stream: bool
) -> None:
    """What tests/real_engine checks against vLLM: a sampling parameter only the engine
    validates reaches it, and its 400 comes back byte for byte."""
    fields = {**fields, "stream": stream}
    direct = post(sims[0], CHAT, fields)
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}
    relayed = httpx.post(gateway.url + CHAT, json=body, timeout=30)
    assert direct.status_code == relayed.status_code == 400
    assert relayed.content == direct.content
    assert relayed.headers["x-kneecap-backend"].startswith("sim-")
