"""The simulated backend's HTTP face: OpenAI-compatible, in vLLM's wire format.

The engine behind it decides *when* tokens come (``AsyncEngine``); this module
only decides what they look like. A client that disconnects closes the
engine's iterator, which frees the sequence.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.sim import wire
from backends.sim.base import AsyncEngine, GenerationRequest, TokenIterator
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens

DEFAULT_MAX_TOKENS = 256
EMBEDDING_DIM = 16


def _error(
    message: str, status: int, error_type: str = "BadRequestError", param: str | None = None
) -> Response:
    return Response(
        wire.error(message, error_type, status, param),
        status_code=status,
        media_type="application/json",
    )


def _prompt_tokens(payload: dict[str, Any]) -> int:
    if "messages" in payload:
        return count_chat_tokens(payload["messages"])
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        return sum(count_text_tokens(p) if isinstance(p, str) else 1 for p in prompt)
    return count_text_tokens(str(prompt))


def create_sim_app(engine: AsyncEngine, model: str) -> Starlette:
    max_model_len = engine.max_model_len
    # Requests without a client seed still get distinct EOS draws and texts.
    unseeded = itertools.count(1)

    async def parse(request: Request) -> tuple[dict[str, Any], bytes] | Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            return _error("Invalid JSON body", 400)
        if not isinstance(payload, dict):
            return _error("Body must be a JSON object", 400)
        if payload.get("model") != model:
            return _error(
                f"The model `{payload.get('model')}` does not exist.", 404, "NotFoundError", "model"
            )
        return payload, body

    async def generate(request: Request) -> Response:
        parsed = await parse(request)
        if isinstance(parsed, Response):
            return parsed
        payload, _ = parsed
        chat = request.url.path.endswith("/chat/completions")
        if chat and not isinstance(payload.get("messages"), list):
            return _error("messages: field required", 400, param="messages")
        if not chat and "prompt" not in payload:
            return _error("prompt: field required", 400, param="prompt")
        prompt_tokens = _prompt_tokens(payload)
        max_tokens = (
            payload.get("max_tokens") or payload.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
        )
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error("max_tokens must be a positive integer", 400, param="max_tokens")
        if prompt_tokens + max_tokens > max_model_len:
            requested = prompt_tokens + max_tokens
            return _error(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {requested} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion).",
                400,
            )
        ident = wire.Identity.for_request("chatcmpl" if chat else "cmpl", payload)
        seed = payload["seed"] if isinstance(payload.get("seed"), int) else next(unseeded)
        gen = GenerationRequest(
            request_id=ident.id,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            ignore_eos=bool(payload.get("ignore_eos", False)),
            seed=seed,
        )
        try:
            tokens = engine.generate(gen)
        except ValueError as exc:  # can never fit this engine's KV cache
            return _error(str(exc), 400)
        if payload.get("stream"):
            options = payload.get("stream_options") or {}
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return StreamingResponse(
                _stream(tokens, gen, ident, chat, include_usage), media_type="text/event-stream"
            )
        return await _complete(tokens, gen, ident, chat)

    async def _stream(
        tokens: TokenIterator,
        gen: GenerationRequest,
        ident: wire.Identity,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        completion = 0
        try:
            if chat:
                yield wire.chat_chunk(ident, model, {"role": "assistant", "content": ""}, None)
            async for event in tokens:
                completion += 1
                text = wire.token_text(gen.seed, event.index)
                if chat:
                    yield wire.chat_chunk(ident, model, {"content": text}, event.finish_reason)
                else:
                    yield wire.completion_chunk(ident, model, text, event.finish_reason)
        finally:
            await tokens.aclose()
        if include_usage:
            name = "chat.completion.chunk" if chat else "text_completion"
            yield wire.usage_chunk(ident, model, name, gen.prompt_tokens, completion)
        yield wire.DONE

    async def _complete(
        tokens: TokenIterator, gen: GenerationRequest, ident: wire.Identity, chat: bool
    ) -> Response:
        parts = []
        finish = None
        try:
            async for event in tokens:
                parts.append(wire.token_text(gen.seed, event.index))
                finish = event.finish_reason
        finally:
            await tokens.aclose()  # the client may have gone: free the sequence
        usage = wire.usage(gen.prompt_tokens, len(parts))
        body = wire.full_response(ident, model, chat, "".join(parts), finish, usage)
        return Response(body, media_type="application/json")

    async def embeddings(request: Request) -> Response:
        parsed = await parse(request)
        if isinstance(parsed, Response):
            return parsed
        payload, _ = parsed
        inputs = payload.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            return _error("input: field required", 400, param="input")
        data = []
        total = 0
        for index, item in enumerate(inputs):
            text = item if isinstance(item, str) else json.dumps(item)
            total += count_text_tokens(text)
            digest = hashlib.sha256(text.encode()).digest()
            vector = [
                round(v / 255.0, 6)
                for v in struct.unpack(f"{EMBEDDING_DIM}B", digest[:EMBEDDING_DIM])
            ]
            data.append({"object": "embedding", "embedding": vector, "index": index})
        body = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
        return Response(wire.dumps(body), media_type="application/json")

    async def tokenize(request: Request) -> Response:
        parsed = await parse(request)
        if isinstance(parsed, Response):
            return parsed
        payload, _ = parsed
        count = _prompt_tokens(payload)
        return JSONResponse(
            {"count": count, "max_model_len": max_model_len, "tokens": list(range(count))}
        )

    async def models(request: Request) -> Response:
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "kneecap-sim",
            "max_model_len": max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(engine.render_metrics(), media_type="text/plain; version=0.0.4")

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.aclose()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
