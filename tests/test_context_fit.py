"""What the gateway refuses for want of context, and where the rest goes.

The gateway refuses on its own only a prompt that leaves no context room for one output
token. Prompt + max_tokens over the context is the engine's to judge: vLLM 0.32 and SGLang
stop the output at the context, an older vLLM (and the simulator) answers its own 400.
Replicas whose context holds the whole request are preferred while any is healthy.

The simulator's real context is 40,960 tokens; a smaller ``max_model_len`` in the
gateway's config stands for a smaller engine, so what the gateway forwards is served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.long_context import FIRST_TOKEN, exceeds_every_context, output_to_hold
from tests.procs import MODEL, Gateway, Proc, backend, start_gateway, start_sim, wait_until
from tests.test_routing_http import Hold, backend_state

CONTEXT = 2048  # the bug report's engine: --max-model-len 2048
PROMPT_151 = "abcd" * 144  # 144 tokens of text + 7 of chat template: 151, estimated or counted
FAST_HEALTH = {"interval_s": 0.1}


# --- the pure rules ----------------------------------------------------------------------


def test_only_a_prompt_without_room_for_one_token_exceeds_every_context() -> None:
    assert not exceeds_every_context([CONTEXT], CONTEXT - 1, FIRST_TOKEN)
    assert exceeds_every_context([CONTEXT], CONTEXT, FIRST_TOKEN)
    assert not exceeds_every_context([CONTEXT, 4096], CONTEXT, FIRST_TOKEN)


def test_the_requested_output_is_held_where_some_context_holds_it() -> None:
    assert output_to_hold([CONTEXT, 4096], 151, 1990) == 1990
    assert output_to_hold([CONTEXT, None], 151, 1990) == 1990  # unknown may hold it
    assert output_to_hold([CONTEXT], 58, 1990) == 1990  # 2048 exactly
    # Nowhere: any replica that can start it may take it, and its engine decides.
    assert output_to_hold([CONTEXT], 59, 1990) == FIRST_TOKEN
    assert output_to_hold([CONTEXT, 1024], 151, 1990) == FIRST_TOKEN


# --- through the gateway -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """Two fast simulators: ``small`` and ``big`` only by what the gateway is told."""
    tmp = tmp_path_factory.mktemp("context_fit")
    started: dict[str, Proc] = {}
    try:
        for name in ("small", "big"):
            started[name] = start_sim(tmp, ttft_ms=5, itl_ms=0.2)
        yield started
    finally:
        for proc in started.values():
            proc.stop()


def gateway(tmp_path: Path, backends: list[dict], **extra: Any) -> Gateway:
    config = {
        "backends": backends,
        "pools": {"short": {"max_prompt_tokens": 8192}, "long": {"min_prompt_tokens": 8192}},
        **extra,
    }
    return start_gateway(tmp_path, config)


def chat(text: str, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
    }


def post(gw: Gateway, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=30)


def test_a_prompt_that_fits_without_its_max_tokens_is_forwarded(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    """The bug report's request: 151 + 1990 on a 2048 context. vLLM 0.32 serves it
    (stopping at 2048 tokens); the gateway refused it with its own 400."""
    gw = gateway(tmp_path, [backend("s0", sims["small"].url, max_model_len=CONTEXT)])
    try:
        response = post(gw, chat(PROMPT_151, max_tokens=1990))
        assert response.status_code == 200, response.text
        assert response.headers["x-kneecap-backend"] == "s0"
        usage = response.json()["usage"]  # the simulator's own answer
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (151, 1990)
        # Its token budget counts at most the context: the engine stops the output there,
        # so that is all the KV cache it can hold (not 151 + 40,000).
        hold = Hold(gw, chat(PROMPT_151, max_tokens=40_000))
        wait_until(lambda: backend_state(gw, "s0")["in_flight"] == 1)
        assert backend_state(gw, "s0")["tokens_in_flight"] == CONTEXT
        assert hold.end() == (200, "s0")
    finally:
        gw.proc.stop()


def test_the_engines_own_refusal_reaches_the_client_byte_for_byte(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    """``max_tokens`` over the context: vLLM 0.32 (and the simulator) refuse it in their own
    words, which the gateway passes on untouched."""
    sim = sims["big"]
    gw = gateway(tmp_path, [backend("l0", sim.url, "long", max_model_len=40_960)])
    try:
        body = chat("abcd" * 38_000, max_tokens=40_961)
        response = post(gw, body)
        direct = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30)
        assert direct.status_code == 400  # the simulator does refuse it
        assert response.status_code == 400
        assert response.headers["x-kneecap-backend"] == "l0"
        assert response.content == direct.content
    finally:
        gw.proc.stop()


def test_a_pool_holding_the_whole_request_is_preferred_while_one_is_healthy(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    tall = start_sim(tmp_path, ttft_ms=5, itl_ms=0.2)  # this test stops it
    backends = [
        backend("small", sims["small"].url, "short", max_model_len=CONTEXT),
        backend("tall", tall.url, "long", max_model_len=4096),
    ]
    gw = gateway(tmp_path, backends, health=FAST_HEALTH)
    try:
        whole = chat(PROMPT_151, max_tokens=1990)  # short by length; fits only `tall`
        assert {post(gw, whole).headers["x-kneecap-backend"] for _ in range(6)} == {"tall"}
        brief = chat(PROMPT_151, max_tokens=4)  # fits both: its own pool's
        assert {post(gw, brief).headers["x-kneecap-backend"] for _ in range(6)} == {"small"}
        tall.stop()
        wait_until(lambda: not backend_state(gw, "tall")["healthy"])
        # No healthy replica holds it all now: one that holds the prompt takes it.
        response = post(gw, whole)
        assert response.status_code == 200, response.text
        assert response.headers["x-kneecap-backend"] == "small"
    finally:
        gw.proc.stop()
        tall.stop()


def test_replicas_of_one_pool_holding_the_whole_request_are_its_only_candidates(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    backends = [
        backend("small", sims["small"].url, "short", max_model_len=CONTEXT),
        backend("roomy", sims["big"].url, "short", max_model_len=4096),
    ]
    gw = gateway(tmp_path, backends)
    try:
        whole = chat(PROMPT_151, max_tokens=1990)
        assert {post(gw, whole).headers["x-kneecap-backend"] for _ in range(8)} == {"roomy"}
    finally:
        gw.proc.stop()


def test_a_prompt_alone_over_every_context_is_refused_by_the_gateway(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    gw = gateway(tmp_path, [backend("s0", sims["small"].url, max_model_len=CONTEXT)])
    try:
        # 66,007 estimated tokens, and at least 2,062 even at 128 characters a token.
        response = post(gw, chat("abcd" * 66_000, max_tokens=1))
        assert response.status_code == 400
        assert "x-kneecap-backend" not in response.headers  # never sent
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert error["message"] == (
            "This model's maximum context length is 2048 tokens. However, you requested "
            "about 66007 tokens in the prompt, which leaves no room for output."
        )
        # 3,007 estimated tokens may be far fewer (a tokenizer may take 32 characters a
        # token): not surely over, so the engine judges. Refused here before.
        forwarded = post(gw, chat("abcd" * 3000, max_tokens=1))
        assert forwarded.status_code == 200, forwarded.text
        assert forwarded.headers["x-kneecap-backend"] == "s0"
    finally:
        gw.proc.stop()


def test_an_exact_count_is_refused_only_without_room_for_one_token(
    tmp_path: Path, sims: dict[str, Proc]
) -> None:
    """Counted by the backend's /tokenize: the simulator's 4 bytes a token, exactly."""
    gw = gateway(
        tmp_path,
        [backend("s0", sims["small"].url, max_model_len=CONTEXT)],
        routing={"estimator": {"mode": "backend"}},
    )
    try:
        full = post(
            gw, {"model": MODEL, "prompt": "abcd" * CONTEXT, "max_tokens": 1}, "/v1/completions"
        )
        assert full.status_code == 400
        error = full.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert "you requested 2048 tokens in the prompt" in error["message"]
        room = {"model": MODEL, "prompt": "abcd" * (CONTEXT - 1), "max_tokens": 100}
        answer = post(gw, room, "/v1/completions")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kneecap-backend"] == "s0"
    finally:
        gw.proc.stop()
