"""Thin HTTP handlers: parse → check → hand to the proxy. Errors are raised, rendered once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backends.replica import Replica
from gateway.errors import InvalidRequest, PayloadTooLarge, Unauthorized
from gateway.metrics import render
from gateway.middleware import RECEIVED_SCOPE_KEY, REQUEST_ID_SCOPE_KEY
from gateway.proxy import ProxyRequest, proxy
from gateway.relay import StreamRelay
from gateway.routing import token_limit_of
from gateway.runtime import Runtime
from gateway.settings import Settings

# The field each endpoint cannot do without, besides `model`.
REQUIRED_FIELD = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
}


def runtime_of(request: Request) -> Runtime:
    return request.state.runtime


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def require_client_key(request: Request) -> str:
    """The caller's priority class; 401 unless the key is accepted."""
    priority = runtime_of(request).current.client_priority(bearer(request))
    if priority is None:
        raise Unauthorized("Incorrect or missing API key.")
    return priority


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_payload(body: bytes, endpoint: str) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    for field in ("model", REQUIRED_FIELD[endpoint]):
        if payload.get(field) in (None, "", []):
            raise InvalidRequest(
                f"you must provide the `{field}` parameter",
                param=field,
                code="missing_required_parameter",
            )
    if not isinstance(payload["model"], str):
        raise InvalidRequest("`model` must be a string", param="model", code="invalid_type")
    if endpoint == "/v1/chat/completions" and not isinstance(payload["messages"], list):
        raise InvalidRequest("`messages` must be an array", param="messages", code="invalid_type")
    return payload


async def proxied(request: Request) -> Any:
    started = request.scope.get(RECEIVED_SCOPE_KEY) or time.perf_counter()
    key_priority = require_client_key(request)
    runtime = runtime_of(request)
    endpoint = request.scope["path"]  # request.url would build a whole URL object
    body = await read_body(request, runtime.current.settings.max_body_bytes)
    payload = parse_payload(body, endpoint)
    proxy_request = ProxyRequest(
        endpoint=endpoint,
        payload=payload,
        body=body,
        headers=request.headers,
        request_id=request.scope.get(REQUEST_ID_SCOPE_KEY, ""),
        started=started,
        key_priority=key_priority,
    )
    return await until_client_leaves(request, proxy(runtime, proxy_request))


async def until_client_leaves(
    request: Request, work: Coroutine[Any, Any, Response | StreamRelay]
) -> Response | StreamRelay:
    """Run ``work`` unless the client disconnects first (e.g. while queued).

    uvicorn does not cancel a handler whose client went away; without this a
    request waiting for admission would hold its queue place until its deadline,
    and a non-streamed request would keep its engine busy. A watcher task
    cancels this (the handler's) task when the disconnect arrives; the
    cancellation lands inside ``work``, whose own cleanup releases what it
    holds. (An anyio task group here cost half of a short request's CPU.)
    Once ``work`` returns, the relay watches for disconnects itself.
    """
    handler = asyncio.current_task()
    assert handler is not None
    state = {"left": False, "done": False}

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                if not state["done"]:
                    state["left"] = True
                    handler.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        result = await work
        state["done"] = True
        return result
    except asyncio.CancelledError:
        if not state["left"]:
            raise
        handler.uncancel()
        return Response(status_code=499)  # nobody is listening any more
    finally:
        watcher.cancel()


async def list_models(request: Request) -> Response:
    require_client_key(request)
    models = runtime_of(request).current.backends.healthy_models()
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "kneecap"} for m in models]
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    backends = runtime_of(request).current.backends
    healthy = sum(r.healthy for r in backends.replicas)
    body = {"ready": healthy > 0, "healthy_backends": healthy, "backends": len(backends.replicas)}
    return JSONResponse(body, status_code=200 if healthy else 503)


def require_admin(request: Request) -> None:
    if not runtime_of(request).current.admin_ok(bearer(request)):
        raise Unauthorized("Incorrect or missing admin token.")


async def admin_reload(request: Request) -> Response:
    require_admin(request)
    result = runtime_of(request).reload()
    return JSONResponse(
        {"ok": result.ok, "message": result.message}, status_code=200 if result.ok else 400
    )


def backend_view(replica: Replica, now: float, mono: float, settings: Settings) -> dict[str, Any]:
    engine = replica.fresh_engine(mono, settings.measurement.scrape_staleness_s)
    return {
        "name": replica.name,
        "pool": replica.pool,
        "url": replica.url,
        "healthy": replica.healthy,
        "in_flight": replica.in_flight,
        "limit": replica.limit,
        "tokens_in_flight": replica.tokens_in_flight,
        "token_limit": token_limit_of(replica, settings.routing),
        "max_model_len": replica.max_model_len,
        "models": sorted(replica.models),
        "window": replica.window.stats(now).as_dict(),
        "engine": None
        if engine is None
        else {"running": engine.running, "waiting": engine.waiting, "kv_usage": engine.kv_usage},
    }


async def admin_state(request: Request) -> Response:
    require_admin(request)
    runtime = runtime_of(request)
    now, mono = time.perf_counter(), time.monotonic()
    settings = runtime.current.settings
    backends = [backend_view(r, now, mono, settings) for r in runtime.current.backends.replicas]
    pools = {
        name: {"queue_depth": a.depth(), "leased": a.leased}
        for name, a in runtime.admissions.items()
    }
    routing = {
        "estimator": settings.routing.estimator.mode,
        "calibration": runtime.routing.calibration.state(),
        "sessions": len(runtime.routing.sessions),
    }
    return JSONResponse({"backends": backends, "pools": pools, "routing": routing})


async def admin_requests(request: Request) -> Response:
    """The last requests' own measurements, newest last (``?limit=N``, default 50)."""
    require_admin(request)
    limit = request.query_params.get("limit", "50")
    if not limit.isdigit():
        raise InvalidRequest("limit must be a non-negative integer", param="limit")
    recent = list(runtime_of(request).recorder.recent)[-int(limit) :] if int(limit) else []
    return JSONResponse({"requests": [r.summary() for r in recent]})


async def metrics(request: Request) -> Response:
    runtime = runtime_of(request)
    runtime.refresh_gauges()
    body, content_type = render(runtime.metrics_registry, request.headers.get("accept"))
    return Response(body, headers={"content-type": content_type})


ROUTES = [
    Route("/v1/chat/completions", proxied, methods=["POST"]),
    Route("/v1/completions", proxied, methods=["POST"]),
    Route("/v1/embeddings", proxied, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/admin/reload", admin_reload, methods=["POST"]),
    Route("/admin/state", admin_state, methods=["GET"]),
    Route("/admin/requests", admin_requests, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
