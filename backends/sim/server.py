"""The simulated backend's HTTP face: OpenAI-compatible, in vLLM's wire format.

The engine behind it decides *when* tokens come (``AsyncEngine``); this module
only decides what they look like. A client that disconnects closes the
engine's iterator, which frees the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.sim import embeddings as embedding
from backends.sim import multi, prompt_list, validate, wire
from backends.sim.arrival import arrival_of
from backends.sim.base import AsyncEngine, GenerationRequest, TokenIterator
from backends.sim.extras import Extras, choice_logprobs
from backends.sim.request_fields import Unreadable, validation_error
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens

_T = TypeVar("_T")
VLLM_VERSION = "0.32.0"  # the server whose answers the simulator's are


def _error(
    message: str, status: int, error_type: str = "BadRequestError", param: str | None = None
) -> Response:
    return Response(
        wire.error(message, error_type, status, param),
        status_code=status,
        media_type="application/json",
    )


def _prompt_tokens(payload: dict[str, Any]) -> int:
    """What ``/tokenize`` counts: the messages, or every prompt of ``prompt``.

    vLLM 0.32's ``/tokenize`` takes a string only (a list is its 400); the simulator counts
    a list as ``/v1/completions`` reads it, each prompt once, and the gateway's backend
    estimator counts a batch so."""
    if "messages" in payload:
        return count_chat_tokens(payload["messages"], payload.get("tools"))
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        return sum(validate.tokens_of(p) for p in prompt_list.prompts(prompt))
    return count_text_tokens(str(prompt))


def _unreadable(unreadable: Unreadable) -> Response:
    bad = validation_error(unreadable.errors)
    return _error(bad.message, 400, bad.error_type, bad.param)


class _Completions:
    """``POST /v1/chat/completions`` and ``/v1/completions`` as a pure ASGI app.

    This is the path every token takes, and at ``--speed K`` whatever time it
    costs counts K times over in engine time: a client at speed 20 that waits
    half a millisecond for the server sees 10 ms of TTFT the modelled GPU never
    spent. So it skips the framework: no middleware, routing or request object
    on the way in, and one ``send`` per chunk on the way out, raced against the
    client's disconnect (which cancels the sequence) as Starlette's streaming
    response does.
    """

    def __init__(self, engine: AsyncEngine, model: str) -> None:
        self._engine = engine
        self._model = model
        # Requests without a client seed still get distinct EOS draws and texts.
        self._unseeded = itertools.count(1)
        # The engine's request ids: a seeded request's wire id is the same every time, and
        # two such requests at once must still be two sequences (vLLM's ids are its own too).
        self._submitted = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before sending its request
        chat = scope["path"].endswith("/chat/completions")
        started = self._start(body, chat, arrival_of(scope))
        if isinstance(started, Response):
            await started(scope, receive, send)
        elif isinstance(started, _Batch):
            await self._serve_batch(started, scope, receive, send)
        elif started.stream:
            await self._stream(started, receive, send)
        else:
            answer = await self._unless_left(self._complete(started), receive)
            if answer is not None:
                await answer(scope, receive, send)

    def _start(
        self, body: bytes, chat: bool, arrival: float | None
    ) -> _Generation | _Batch | Response:
        """Check the request and submit it to the engine, arriving when its bytes did."""
        payload = _payload(body, self._model)
        if isinstance(payload, Response):
            return payload
        try:
            asked = validate.read(payload, chat, self._engine.max_model_len)
        except validate.EngineRefusal as refusal:
            if not refusal.stream:
                return _error(refusal.message, 400, refusal.error_type, refusal.param)
            error = wire.stream_error(refusal.message, refusal.error_type, 400, refusal.param)
            return StreamingResponse(iter((error,)), media_type="text/event-stream")
        except validate.BadRequest as bad:
            return _error(bad.message, 400, bad.error_type, bad.param)
        ident = wire.Identity.for_request("chatcmpl" if chat else "cmpl", payload)
        seed = payload["seed"] if isinstance(payload.get("seed"), int) else next(self._unseeded)
        request_id = f"{ident.id}#{next(self._submitted)}"
        if asked.n > 1 or asked.prompts:  # several sequences: their own path
            if not isinstance(payload.get("seed"), int):  # the next request's seeds follow
                self._unseeded = itertools.count(seed + asked.sequences)
            return _Batch(asked, ident, chat, multi.sequences(asked, request_id, seed), arrival)
        gen = GenerationRequest(
            request_id=request_id,
            prompt_tokens=asked.prompt_tokens,
            max_tokens=asked.max_tokens,
            ignore_eos=asked.ignore_eos,
            seed=seed,
        )
        try:
            tokens = self._engine.generate(gen, arrival)
        except ValueError as exc:  # can never fit this engine's KV cache
            return _error(str(exc), 400)
        return _Generation(
            tokens,
            gen,
            ident,
            chat,
            stream=asked.stream,
            include_usage=asked.include_usage,
            extras=asked.extras,
        )

    async def _stream(self, run: _Generation, receive: Receive, send: Send) -> None:
        model = self._model
        tokens = run.tokens
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        streaming = asyncio.current_task()
        assert streaming is not None
        left: list[bool] = []
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(_cancel_on_disconnect(receive, streaming, left))
            try:
                chunks = wire.TokenChunks(
                    run.ident,
                    model,
                    run.chat,
                    extras=run.extras,
                    prompt_tokens=run.gen.prompt_tokens,
                    echo=run.extras.echoed(0, 1),
                )
                if run.chat:
                    await send(_more(chunks.role()))
                seed = run.gen.seed
                completion = 0
                last = b""  # the finishing chunk goes out with the usage chunk and [DONE]
                async for event in tokens:
                    completion += 1
                    chunk = chunks.token(seed, event.index, event.finish_reason)
                    if event.finish_reason is None:
                        await send(_more(chunk))
                    else:
                        last = chunk
                if run.include_usage:
                    name = "chat.completion.chunk" if run.chat else "text_completion"
                    prompt = run.gen.prompt_tokens
                    last += wire.usage_chunk(run.ident, model, name, prompt, completion)
                await send({"type": "http.response.body", "body": last + wire.DONE})
            except asyncio.CancelledError:
                if not left:
                    raise
                streaming.uncancel()  # the client left: the stream just ends
            finally:
                watcher.cancel()
                await tokens.aclose()  # cancels the sequence, once the loop let go of it

    async def _unless_left(self, work: Awaitable[_T], receive: Receive) -> _T | None:
        """What ``work`` gives, or None when the client left first: its sequences are freed
        at once, as vLLM aborts a request whose client disconnected, streamed or not."""
        working = asyncio.current_task()
        assert working is not None
        left: list[bool] = []
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(_cancel_on_disconnect(receive, working, left))
            try:
                return await work
            except asyncio.CancelledError:
                if not left:
                    raise
                working.uncancel()  # the client left: nobody to answer
                return None
            finally:
                watcher.cancel()

    async def _serve_batch(self, batch: _Batch, scope: Scope, receive: Receive, send: Send) -> None:
        """Several sequences: a path of its own, so that one sequence pays nothing for it."""
        try:
            merged = await multi.start(self._engine, batch.gens, batch.arrival)
        except ValueError as exc:  # one can never fit this engine's KV cache
            await _error(str(exc), 400)(scope, receive, send)
            return
        seeds = [gen.seed for gen in batch.gens]
        asked, ident, chat, model = batch.asked, batch.ident, batch.chat, self._model
        if not asked.stream:
            body = await self._unless_left(
                multi.complete(merged, asked, ident, model, chat, seeds), receive
            )
            if body is not None:
                await Response(body, media_type="application/json")(scope, receive, send)
            return

        async def more(chunk: bytes) -> None:
            await send(_more(chunk))

        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        last = await self._unless_left(
            multi.stream(merged, asked, ident, model, chat, seeds, more), receive
        )
        if last is not None:
            await send({"type": "http.response.body", "body": last})

    async def _complete(self, run: _Generation) -> Response:
        parts = []
        finish = None
        try:
            async for event in run.tokens:
                parts.append(wire.token_text(run.gen.seed, event.index))
                finish = event.finish_reason
        finally:
            await run.tokens.aclose()  # the client may have gone: free the sequence
        usage = wire.usage(run.gen.prompt_tokens, len(parts))
        echo = run.extras.echoed(0, 1)
        text = echo + "".join(parts)
        logprobs = None
        if run.extras.logprobs is not None:
            tokens = range(len(parts))
            top = run.extras.logprobs
            logprobs = [choice_logprobs(run.chat, run.gen.seed, tokens, top, 0, echo)]
        answers = [(text, finish)]
        body = wire.full_responses(run.ident, self._model, run.chat, answers, usage, logprobs)
        return Response(body, media_type="application/json")


@dataclass(frozen=True, slots=True)
class _Batch:
    """A request of several sequences, not submitted yet (see :mod:`.multi`)."""

    asked: validate.Asked
    ident: wire.Identity
    chat: bool
    gens: list[GenerationRequest]
    arrival: float | None


@dataclass(frozen=True, slots=True)
class _Generation:
    tokens: TokenIterator
    gen: GenerationRequest
    ident: wire.Identity
    chat: bool
    stream: bool
    include_usage: bool
    extras: Extras


# StreamingResponse(media_type="text/event-stream")'s headers, as vLLM's server sends them.
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _more(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


async def _read_body(receive: Receive) -> bytes | None:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _cancel_on_disconnect(
    receive: Receive, streaming: asyncio.Task, left: list[bool]
) -> None:
    """Stops the streaming (or generating) loop when the client goes. Not by closing its
    token iterator from here: an async generator (the fixed-latency engine's) cannot be
    closed while the loop is inside it, and every disconnect logged a RuntimeError."""
    while (await receive())["type"] != "http.disconnect":
        pass
    left.append(True)
    streaming.cancel()


def _payload(body: bytes, model: str) -> dict[str, Any] | Response:
    try:
        payload = json.loads(body)
    except ValueError:
        return _error("Invalid JSON body", 400)
    if not isinstance(payload, dict):
        return _error("Body must be a JSON object", 400)
    # vLLM serves its one model to a request that names none (or names it empty).
    if payload.get("model") and payload["model"] != model:
        return _error(
            f"The model `{payload.get('model')}` does not exist.", 404, "NotFoundError", "model"
        )
    return payload


class _SimApp:
    """The completions endpoints first, everything else through Starlette."""

    def __init__(self, completions: ASGIApp, rest: ASGIApp) -> None:
        self._completions = completions
        self._rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _GENERATE:
            await self._completions(scope, receive, send)
        else:
            await self._rest(scope, receive, send)


_GENERATE = ("/v1/chat/completions", "/v1/completions")


def create_sim_app(engine: AsyncEngine, model: str) -> ASGIApp:
    max_model_len = engine.max_model_len
    completions = _Completions(engine, model)

    async def parse(request: Request) -> dict[str, Any] | Response:
        return _payload(await request.body(), model)

    async def not_routed(request: Request) -> Response:
        raise AssertionError("the completions endpoints are served by _Completions")

    async def embeddings(request: Request) -> Response:
        payload = await parse(request)
        if isinstance(payload, Response):
            return payload
        try:
            body = embedding.answer(payload, model, max_model_len)
        except validate.BadRequest as bad:
            return _error(bad.message, 400, bad.error_type, bad.param)
        return Response(body, media_type="application/json")

    async def tokenize(request: Request) -> Response:
        payload = await parse(request)
        if isinstance(payload, Response):
            return payload
        try:
            count = _prompt_tokens(payload)
        except Unreadable as unreadable:
            return _unreadable(unreadable)
        except (AttributeError, TypeError, UnicodeEncodeError) as exc:
            return _error(f"prompt: invalid: {type(exc).__name__}", 400)
        return JSONResponse(
            {"count": count, "max_model_len": max_model_len, "tokens": list(range(count))}
        )

    async def models(request: Request) -> Response:
        now = int(time.time())  # vLLM stamps its cards when listed
        card = {
            "id": model,
            "object": "model",
            "created": now,
            "owned_by": "kneecap-sim",  # vLLM's "vllm": this one says what answers
            "root": model,
            "parent": None,
            "max_model_len": max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": now,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def http_error(request: Request, exc: Exception) -> Response:
        # FastAPI's answer to a route or method vLLM does not serve.
        assert isinstance(exc, HTTPException)
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Everything built so far lives as long as the server: keep it out of the
        # collector's full passes, which would otherwise stall every stream (tens of
        # milliseconds, multiplied by the speed-up) whenever connections pile up.
        gc.freeze()
        await engine.start()
        try:
            yield
        finally:
            await engine.aclose()

    rest = Starlette(
        routes=[
            # Registered so that other methods get Starlette's 405; POSTs never get here.
            Route("/v1/chat/completions", not_routed, methods=["POST"]),
            Route("/v1/completions", not_routed, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    return _SimApp(completions, rest)
