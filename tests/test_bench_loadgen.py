"""A short real sweep over HTTP against a tiny streaming server, and bad targets.

The server streams vLLM-style chunks (role-only first chunk, one content chunk
per token, finish chunk, usage chunk, [DONE]) after fixed delays, counts what
it receives, and serves /v1/models and /tokenize under the simulator's
4-bytes-per-token rule.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.sim.tokenizer import count_chat_tokens, count_text_tokens
from gateway.bench import command

TTFT_S = 0.03
ITL_S = 0.004
MODEL = "tiny"


@dataclass
class Seen:
    requests: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (when, then in flight)


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def make_app(seen: Seen) -> Starlette:
    async def models(request: Request) -> Response:
        served = [{"id": MODEL}, {"id": "refuses"}, {"id": "dies"}]
        return JSONResponse({"object": "list", "data": served})

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        count = (
            count_chat_tokens(body["messages"])
            if "messages" in body
            else count_text_tokens(body["prompt"])
        )
        return JSONResponse({"count": count, "max_model_len": 4096})

    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.requests += 1
        seen.bodies.append(body)
        if body["model"] == "refuses":
            error = {"message": "this model refuses", "type": "BadRequestError", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        prompt = count_chat_tokens(body["messages"])
        seen.prompt_tokens.append(prompt)
        n = body["max_tokens"]
        seen.in_flight += 1
        seen.arrivals.append((time.monotonic(), seen.in_flight))

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks():
                    yield chunk
            finally:
                seen.in_flight -= 1

        async def chunks() -> AsyncIterator[bytes]:
            yield _chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(TTFT_S)
            if body["model"] == "dies" and n > 4:  # the probe (4 tokens) passes
                yield _chunk({"content": "tok "})
                raise RuntimeError("backend died mid-stream")
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                yield _chunk({"content": "tok "})
            yield _chunk({}, "length")
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
            data = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            yield b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Seen]]:
    seen = Seen()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue from here on, before uvicorn accepts
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(seen), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _run(argv: list[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    code = command.run(parser.parse_args(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_short_sweep_counts_exactly_and_times_sanely(
    server: tuple[str, Seen], tmp_path: Path
) -> None:
    url, seen = server
    before = seen.requests
    out_json = tmp_path / "out.json"
    code, out, err = _run(
        [
            "--url",
            url + "/v1",
            "--concurrency",
            "1,4",
            "--requests",
            "8",
            "--warmup",
            "2",
            "--prompt-tokens",
            "300",
            "--output-tokens",
            "12",
            "--stagger",
            "0",  # all clients at once: the exact request count below
            "--slo",
            "ttft_p95_ms=400",
            "--json",
            str(out_json),
            "--csv",
            str(tmp_path / "out.csv"),
        ]
    )
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    points = doc["points"]
    assert [p["load"] for p in points] == [1, 4]
    for p in points:
        assert p["requests"] == 8 and p["errors"] == 0
        assert p["output_tokens_mean"] == 12
        assert p["prompt_tokens_mean"] == 300  # exact, checked by the server's own count
        ttft = p["ttft_ms"]
        assert TTFT_S * 1e3 <= ttft["p50"] < TTFT_S * 1e3 + 60
        assert ITL_S * 1e3 * 0.8 <= p["itl_ms"]["p50"] < ITL_S * 1e3 + 20
        e2e_floor = (TTFT_S + 11 * ITL_S) * 1e3
        assert e2e_floor <= p["e2e_ms"]["p50"] < e2e_floor + 150
        assert p["slo_ok"] is True
        assert p["goodput_request_s"] == pytest.approx(p["request_s"], rel=1e-3)
    # Four streams share the server: about four times the requests per second.
    assert points[1]["output_tok_s"] > 2.5 * points[0]["output_tok_s"]
    # Probe + per point (warm-up + counted + at most load-1 fillers), nothing more.
    sent = seen.requests - before
    assert 1 + (2 + 8) + (2 + 8) <= sent <= 1 + (2 + 8) + (2 + 8 + 3)
    assert all(300 == n for n in seen.prompt_tokens[-16:])
    body = seen.bodies[-1]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["max_tokens"] == 12
    assert "/tokenize counts 300" in out
    assert "knee" in out and (tmp_path / "out.csv").read_text().count("\n") == 3


def test_closed_loop_clients_start_a_stagger_apart(server: tuple[str, Seen]) -> None:
    url, seen = server
    before = len(seen.arrivals)
    code, _, err = _run(
        [
            "--url",
            url,
            "--concurrency",
            "3",
            "--requests",
            "6",
            "--prompt-tokens",
            "64",
            "--output-tokens",
            "30",  # a request lasts ~0.15 s: longer than a stagger, shorter than the ramp
            "--stagger",
            "0.1",
            "--quiet",
        ]
    )
    assert code == 0, err
    arrivals = seen.arrivals[before + 1 :]  # after the probe
    start = arrivals[0][0]
    for when, in_flight in arrivals:
        started = 1 + int((when - start) / 0.1 + 0.2)  # clients that may have started by then
        assert in_flight <= min(3, started), (when - start, in_flight)
    assert max(n for _, n in arrivals) == 3


def test_open_loop_at_a_rate(server: tuple[str, Seen]) -> None:
    url, _ = server
    code, out, err = _run(
        [
            "--url",
            url,
            "--rate",
            "40",
            "--arrival",
            "constant",
            "--requests",
            "10",
            "--warmup",
            "2",
            "--prompt-tokens",
            "64",
            "--output-tokens",
            "4",
            "--quiet",
        ]
    )
    assert code == 0, err
    assert err == ""  # --quiet
    row = [line for line in out.splitlines() if line.strip().startswith("40 ")]
    assert row, out


def test_duplicate_prompt_prefixes_are_avoided(server: tuple[str, Seen]) -> None:
    url, seen = server
    code, _, err = _run(
        [
            "--url",
            url,
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--warmup",
            "0",
            "--prompt-tokens",
            "40",
            "--output-tokens",
            "2",
            "--quiet",
        ]
    )
    assert code == 0, err
    prefixes = [b["messages"][0]["content"][:16] for b in seen.bodies[-4:]]
    assert len(set(prefixes)) == 4


def test_requests_failing_mid_stream_are_counted_as_errors(
    server: tuple[str, Seen], tmp_path: Path
) -> None:
    url, _ = server
    out = tmp_path / "dies.json"
    code, text, err = _run(
        [
            "--url",
            url,
            "--model",
            "dies",
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--warmup",
            "0",
            "--prompt-tokens",
            "32",
            "--output-tokens",
            "5",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert code == 0, err
    [point] = json.loads(out.read_text())["points"]
    assert (point["requests"], point["errors"]) == (0, 4)
    assert point["ttft_ms"] is None and point["error_samples"]
    assert "errors at 2:" in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--model", "nope"], "model 'nope' is not served by"),
        (["--model", "refuses"], "probe request failed: HTTP 400: this model refuses"),
        (["--concurrency", "0"], "give positive values"),
        (["--slo", "ttft=5"], "bad SLO term"),
        (["--prompt-tokens", "1024:0.5,8192"], "give weights for every length"),
    ],
)
def test_bad_targets_and_options_end_in_one_line(
    server: tuple[str, Seen], extra: list[str], fragment: str
) -> None:
    url, _ = server
    code, _, err = _run(["--url", url, "--requests", "2", "--quiet", *extra])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kneecap bench: error: ")
    assert fragment in err and "Traceback" not in err


def test_connection_refused_is_one_line() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    code, _, err = _run(["--url", url, "--quiet"])
    assert code == 2
    assert err == f"kneecap bench: error: cannot reach {url}: connection refused or unreachable\n"
