"""The simulated backend answers what vLLM 0.32 answers, over HTTP.

Each case is a divergence found against vLLM 0.32's source
(``vllm/entrypoints/openai/*/protocol.py``, ``serve/utils/api_utils.py:get_max_tokens``,
``renderers/params.py:TokenizeParams``, ``sampling_params.py``): the output is capped at
the context, fields are read as pydantic reads them in lax mode, a list of prompts is
several sequences (served as vLLM serves them: ``tests/test_sim_multi.py``) and a list
of token ids is one prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.base import GenerationRequest
from backends.sim.sequence import draw_output_length
from tests.procs import MODEL, Proc, free_port, served, start_sim, wait_until

CONTEXT = 40_960  # the fixed-latency engine's and qwen3-4b's max_model_len
PROFILE = "qwen3-4b/l40s/bf16/vllm"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim_fidelity")


@pytest.fixture(scope="module")
def sim(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_sim(module_tmp, ttft_ms=1, itl_ms=0))


@pytest.fixture(scope="module")
def profiled(module_tmp: Path) -> Iterator[Proc]:
    """A calibrated engine: the only one that draws an EOS, so reads ``ignore_eos``."""
    yield from served(start_sim(module_tmp, profile=PROFILE, speed=50))


def post(proc: Proc, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(proc.url + path, json={"model": MODEL, **body}, timeout=30)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(response: httpx.Response) -> tuple[str, str | None]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return error["message"], error["param"]


def stream_events(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    datas = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


# --- 1. the output is capped at the context --------------------------------------


def test_an_output_over_the_context_is_capped_to_what_the_prompt_leaves(sim: Proc) -> None:
    """vLLM 0.32's get_max_tokens: min(max_model_len - prompt, max_tokens). Before the fix
    the simulator answered 400 for prompt + max_tokens over the context."""
    prompt = [7] * (CONTEXT - 5)  # token ids: exactly CONTEXT - 5 prompt tokens
    answer = post(sim, {"prompt": prompt, "max_tokens": 40})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["usage"] == {
        "prompt_tokens": CONTEXT - 5,
        "total_tokens": CONTEXT,
        "completion_tokens": 5,
    }
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_capped_stream_ends_at_the_context_with_length(sim: Proc) -> None:
    prompt = [7] * (CONTEXT - 3)
    body = {"prompt": prompt, "max_tokens": 100, "stream": True}
    events = stream_events(post(sim, {**body, "stream_options": {"include_usage": True}}))
    finishes = [c["finish_reason"] for e in events for c in e["choices"]]
    assert finishes == [None, None, "length"]
    assert events[-1]["usage"]["completion_tokens"] == 3


def test_a_completion_without_max_tokens_gets_vllms_sixteen(sim: Proc) -> None:
    answer = post(sim, {"prompt": "hi"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 16
    assert answer.json()["choices"][0]["finish_reason"] == "length"


def test_a_chat_without_max_tokens_is_capped_too(sim: Proc) -> None:
    """The simulator's default chat output (256; vLLM's is the context, with a real
    model's EOS) is capped the same way."""
    messages = [{"role": "user", "content": "abcd" * (CONTEXT - 20)}]  # + the template's
    answer = post(sim, {"messages": messages}, "/v1/chat/completions")
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["total_tokens"] == CONTEXT and usage["completion_tokens"] < 256


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            {"prompt": "hi", "max_tokens": CONTEXT + 1},
            f"max_tokens={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={CONTEXT + 1})",
            "max_tokens",
        ),
        (
            {"prompt": [7] * (CONTEXT + 1), "max_tokens": 1},
            # "at least": vLLM's tokenizer stops one token past the context
            f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
            f"contains at least {CONTEXT + 1} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={CONTEXT + 1})",
            "input_tokens",
        ),
        (  # a prompt that fills the context leaves 0 tokens: SamplingParams refuses 0
            {"prompt": [7] * CONTEXT, "max_tokens": 10},
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "max_tokens",
        ),
        (
            {"prompt": "hi", "max_tokens": 0},
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "max_tokens",
        ),
    ],
    ids=["max-tokens-over-context", "prompt-over-context", "prompt-fills-context", "zero"],
)
def test_what_cannot_fit_is_refused_with_vllms_words(
    sim: Proc, body: dict[str, Any], message: str, param: str
) -> None:
    assert error_of(post(sim, body)) == (message, param)


def test_max_completion_tokens_names_itself_when_over_the_context(sim: Proc) -> None:
    refused = post(sim, chat(max_completion_tokens=CONTEXT + 1), "/v1/chat/completions")
    assert error_of(refused)[1] == "max_completion_tokens"


# --- 2. prompts and inputs: a list of ids is one ------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_is_one_choice_per_prompt(sim: Proc, stream: bool) -> None:
    """vLLM answers one choice per prompt. Refused 400 before multi-sequence requests were
    served (and before that, one choice for both prompts)."""
    for prompt in (["first prompt", "second prompt"], [[1, 2], [3]]):
        answer = post(sim, {"prompt": prompt, "max_tokens": 3, "stream": stream})
        if stream:
            indexes = {c["index"] for e in stream_events(answer) for c in e["choices"]}
        else:
            assert answer.status_code == 200, answer.text
            indexes = {c["index"] for c in answer.json()["choices"]}
        assert indexes == {0, 1}


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [(["abcdefgh"], 2), ([1, 2, 3], 3), ([[1, 2, 3, 4]], 4)],
    ids=["one-string", "token-ids", "one-list-of-ids"],
)
def test_one_prompt_in_a_list_is_one_sequence(sim: Proc, prompt: list, tokens: int) -> None:
    answer = post(sim, {"prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [c["index"] for c in body["choices"]] == [0]
    assert body["usage"]["prompt_tokens"] == tokens


def test_embeddings_of_a_list_of_token_ids_is_one_input(sim: Proc) -> None:
    """OpenAI and vLLM read ``input: [1, 2, 3]`` as one tokenized input (3 before the fix)."""
    answer = post(sim, {"input": [1, 2, 3]}, "/v1/embeddings")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [d["index"] for d in body["data"]] == [0]
    assert body["usage"]["prompt_tokens"] == 3
    several = post(sim, {"input": [[1, 2], [3, 4, 5]]}, "/v1/embeddings").json()
    assert [d["index"] for d in several["data"]] == [0, 1]
    assert several["usage"]["prompt_tokens"] == 5


# The simulator's one reader of a list prompt (backends/sim/prompt_list.py), read laxly as
# vLLM's pydantic reads it: (prompt, inputs, tokens).
LAX_LISTS = [(["1", 2], 1, 2), ([["1"], [2, "3"]], 2, 3), (["abcdefgh", "abcd"], 2, 3)]


@pytest.mark.parametrize(
    ("prompt", "inputs", "tokens"), LAX_LISTS, ids=["lax-ids", "lax-id-lists", "strings"]
)
def test_tokenize_and_embeddings_read_a_list_as_completions_do(
    sim: Proc, prompt: list, inputs: int, tokens: int
) -> None:
    """``/tokenize`` counts what ``/v1/completions`` runs, and vLLM reads embeddings'
    ``input`` as the same union. Before, both had their own reader: ``["1", 2]`` was one
    prompt of ids [1, 2] to /v1/completions, a 400 (TypeError) to /tokenize and two
    inputs to /v1/embeddings."""
    served = post(sim, {"prompt": prompt, "max_tokens": 1})
    assert served.status_code == 200, served.text
    assert (len(served.json()["choices"]), served.json()["usage"]["prompt_tokens"]) == (
        inputs,
        tokens,
    )
    counted = httpx.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == tokens
    embedded = post(sim, {"input": prompt}, "/v1/embeddings")
    assert embedded.status_code == 200, embedded.text
    assert (len(embedded.json()["data"]), embedded.json()["usage"]["prompt_tokens"]) == (
        inputs,
        tokens,
    )


def test_a_list_no_reader_reads_is_refused_alike(sim: Proc) -> None:
    """A list that no branch of the union reads: /tokenize answers /v1/completions' 400
    (it answered "prompt: invalid: TypeError"), embeddings locate it at ``input``."""
    refused = post(sim, {"prompt": ["a", 1], "max_tokens": 1})
    tokenized = httpx.post(
        sim.url + "/tokenize", json={"model": MODEL, "prompt": ["a", 1]}, timeout=30
    )
    assert error_of(tokenized) == error_of(refused)
    assert error_of(refused)[1] == "body.prompt.0"
    message, param = error_of(post(sim, {"input": ["a", 1]}, "/v1/embeddings"))
    assert param == "body.input.0"
    assert "'loc': 'body.input.1'" in message and "body.prompt" not in message


# --- 3. a profile names its engine ------------------------------------------------


def test_an_engine_that_contradicts_its_profile_is_named() -> None:
    from backends.sim.profiles import engine_conflict  # new with the fix

    assert engine_conflict(PROFILE, "vllm") is None
    assert engine_conflict("qwen3-4b/l40s/bf16/sglang", "sglang") is None
    assert engine_conflict(PROFILE, "sglang") == (
        f"engine 'sglang' contradicts profile '{PROFILE}', which simulates vllm"
    )


@pytest.mark.parametrize(
    ("profile", "engine"), [(PROFILE, "sglang"), ("qwen3-4b/l40s/bf16/sglang", "vllm")]
)
def test_the_cli_refuses_an_engine_its_profile_contradicts(profile: str, engine: str) -> None:
    """Before: `--engine` was silently ignored and the profile's engine served."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port)]
    command += ["--profile", profile, "--engine", engine]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:

        def settled() -> bool:  # exited, or serving (the bug)
            if process.poll() is not None:
                return True
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
            except httpx.HTTPError:
                return False

        wait_until(settled, timeout=30)
        assert process.poll() == 2
        assert process.stderr is not None
        said = process.stderr.read().strip()
        assert "contradicts profile" in said and "\n" not in said
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)


# --- 4. fields read as pydantic reads them (lax mode) ------------------------------


def test_stream_false_as_a_string_is_no_stream(sim: Proc) -> None:
    answer = post(sim, chat(max_tokens=2, stream="false"), "/v1/chat/completions")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["object"] == "chat.completion"
    assert stream_events(post(sim, chat(max_tokens=2, stream="true"), "/v1/chat/completions"))


def test_ignore_eos_false_as_a_string_lets_the_answer_stop(profiled: Proc) -> None:
    """A seed whose EOS comes early: read as true before the fix, it ran to max_tokens."""

    def natural(seed: int) -> int:  # the EOS draw of the sim's engine (--seed 0)
        return draw_output_length(GenerationRequest("r", 8, 64, seed=seed), 0)[0]

    seed = next(s for s in range(1, 10_000) if natural(s) < 20)
    for ignore_eos, finish, tokens in (("false", "stop", natural(seed)), ("true", "length", 64)):
        body = chat(max_tokens=64, seed=seed, ignore_eos=ignore_eos)
        answer = post(profiled, body, "/v1/chat/completions")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == finish
        assert answer.json()["usage"]["completion_tokens"] == tokens


@pytest.mark.parametrize("value", ["3", 3.0, "3.0", " 3 "])
def test_max_tokens_is_a_lax_integer(sim: Proc, value: Any) -> None:
    answer = post(sim, chat(max_tokens=value, ignore_eos=True), "/v1/chat/completions")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("value", [3.5, "three", [3]])
def test_max_tokens_that_is_no_integer_is_refused(sim: Proc, value: Any) -> None:
    refused = post(sim, chat(max_tokens=value), "/v1/chat/completions")
    assert error_of(refused)[1] == "body.max_tokens"  # pydantic's location, as vLLM names it


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_refused(sim: Proc, path: str) -> None:
    body = {**chat(max_tokens=2), "prompt": "hi", "stream_options": {"include_usage": True}}
    assert error_of(post(sim, body, path)) == (
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        "stream_options",
    )


def test_n_zero_is_refused_with_vllms_words(sim: Proc) -> None:
    refused = post(sim, chat(max_tokens=2, n=0), "/v1/chat/completions")
    assert error_of(refused) == ("n must be at least 1, got 0.", None)
    greedy = post(sim, chat(max_tokens=2, n=2, temperature=0), "/v1/chat/completions")
    assert error_of(greedy) == ("n must be 1 when using greedy sampling, got 2.", None)
    too_many = post(sim, chat(max_tokens=2, n=16385), "/v1/chat/completions")
    assert error_of(too_many) == (
        "n must be at most 16384, got 16385. "
        "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
        None,
    )


def test_an_empty_prompt_is_refused_with_vllms_words(sim: Proc) -> None:
    assert error_of(post(sim, {"prompt": "", "max_tokens": 2})) == (
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        "prompt",
    )


# --- a client that leaves a request it did not stream ---------------------------------


def running(proc: Proc) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


def test_a_client_leaving_a_whole_answer_frees_its_sequence(module_tmp: Path) -> None:
    """vLLM aborts a request whose client disconnected, streamed or not. The simulator only
    did so for streams: a timed-out SDK call kept its sequence running to the end (here
    ~20 s), and its retry doubled the simulated load."""
    slow = start_sim(module_tmp, ttft_ms=1, itl_ms=50)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                slow.url + "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 400},
                timeout=httpx.Timeout(5, read=0.5),
            )
        wait_until(lambda: running(slow) == 0, timeout=5)
    finally:
        slow.stop()
