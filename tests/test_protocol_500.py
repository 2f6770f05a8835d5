"""An app that fails before it answers: the protocol's own 500 is an OpenAI error, as the
proxied endpoints' are, and the connection closes after it as uvicorn's did."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from tests.procs import MODEL
from tests.protocol_server import protocol_server
from tests.test_front_protocol_fixes import CHAT, answers, post

INTERNAL_ERROR = {
    "message": "the gateway failed to handle this request",
    "type": "server_error",
    "param": None,
    "code": "internal_error",
}


async def raises(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        raise RuntimeError("a bug")


async def returns_unanswered(scope: Any, receive: Any, send: Any) -> None:
    pass


@pytest.mark.anyio
@pytest.mark.parametrize("app", [raises, returns_unanswered])
async def test_an_app_that_fails_before_answering_gets_an_openai_500_and_a_close(app: Any) -> None:
    async with protocol_server(app) as (_, reader, writer):
        writer.write(post(CHAT) + post(CHAT))  # kept alive, a second request behind it
        raw = await asyncio.wait_for(reader.read(), 10)  # to the close
    got = answers(raw)
    assert [(status, headers["content-type"]) for status, headers, _ in got] == [
        (500, "application/json")
    ], raw
    assert got[0][1]["connection"] == "close"
    assert json.loads(got[0][2]) == {"error": INTERNAL_ERROR}


@pytest.mark.anyio
async def test_the_openai_sdk_reads_the_500() -> None:
    async with protocol_server(raises) as (_, _, writer):
        port = writer.get_extra_info("peername")[1]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10
        )
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        await client.close()
    assert (failed.value.code, failed.value.type) == ("internal_error", "server_error")
    assert INTERNAL_ERROR["message"] in str(failed.value)
