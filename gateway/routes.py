"""The endpoints besides the proxied ones (those are in ``gateway/front.py``). Errors are
raised, rendered once."""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backends.replica import Replica
from gateway.errors import (
    InvalidRequest,
    ModelNotFound,
    Unauthorized,
    Unavailable,
    UpstreamError,
)
from gateway.front import PROXIED_PATHS, ProxiedEndpoint, bearer, client_priority, read_body
from gateway.metrics import render
from gateway.middleware import REQUEST_ID_SCOPE_KEY
from gateway.overload import GatewayOutOfResources, gateway_overloaded
from gateway.payload import load_json
from gateway.routing import least_busy, token_limit_of
from gateway.runtime import Runtime
from gateway.settings import Settings
from gateway.upstream_identity import upstream_identity


def runtime_of(request: Request) -> Runtime:
    return request.state.runtime


def require_client_key(request: Request) -> str:
    return client_priority(runtime_of(request), request.headers)


async def tokenize(request: Request) -> Response:
    """vLLM's ``POST /tokenize``, answered by a healthy backend of the body's model.

    Not admitted and not measured: it costs the engine no GPU time. Clients such as
    ``kneecap bench`` use it to size prompts exactly through the gateway.
    """
    require_client_key(request)
    runtime = runtime_of(request)
    body = await read_body(
        request.receive, request.headers, runtime.current.settings.max_body_bytes
    )
    if body is None:
        return Response(status_code=204)  # the client hung up; nobody reads this
    payload = load_json(body)
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    model = payload.get("model")
    if model in (None, ""):
        raise InvalidRequest(
            "you must provide the `model` parameter",
            param="model",
            code="missing_required_parameter",
        )
    if not isinstance(model, str):  # as on /v1/*
        raise InvalidRequest("`model` must be a string", param="model", code="invalid_type")
    serving = runtime.current.backends.serving(model)
    if not serving:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    healthy = [r for r in serving if r.healthy]
    if not healthy:
        raise Unavailable(f"no healthy backend serves model `{model}`")
    replica = least_busy(healthy)
    request_id = request.scope[REQUEST_ID_SCOPE_KEY]  # the one its response carries
    forward_key = runtime.current.settings.auth.forward_client_key
    identity = upstream_identity(request.scope["headers"], request_id, replica, forward_key)
    headers = [(b"content-type", b"application/json"), *identity]
    # The live config's timeouts, as for proxied requests: the client's own are startup's.
    timeout = httpx.Timeout(**runtime.current.upstream_timeouts)
    try:
        answer = await runtime.client.post(
            replica.url + "/tokenize", content=body, headers=headers, timeout=timeout
        )
    except (GatewayOutOfResources, httpx.PoolTimeout) as exc:
        warning = runtime.transport.overload_warning
        raise gateway_overloaded(warning, replica, request_id, exc) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"backend {replica.name} failed: {type(exc).__name__}: {exc}") from exc
    return Response(
        answer.content,
        status_code=answer.status_code,
        media_type=answer.headers.get("content-type", "application/json"),
        headers={"x-kneecap-backend": replica.name},
    )


async def list_models(request: Request) -> Response:
    require_client_key(request)
    listing = runtime_of(request).current.backends.model_listing()
    return JSONResponse({"object": "list", "data": listing})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    backends = runtime_of(request).current.backends
    healthy = sum(r.healthy for r in backends.replicas)
    body = {"ready": healthy > 0, "healthy_backends": healthy, "backends": len(backends.replicas)}
    return JSONResponse(body, status_code=200 if healthy else 503)


def require_admin(request: Request) -> None:
    if not runtime_of(request).current.admin_ok(bearer(request.headers)):
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
        "ejection": replica.ejection_view(mono),
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
    runtime.recorder.flush()
    now, mono = time.perf_counter(), time.monotonic()
    settings = runtime.current.settings
    # A backend a reload removed stays listed, marked draining, until its last request ends.
    listed = [(r, False) for r in runtime.current.backends.replicas]
    listed += [(r, True) for r in runtime.draining()]
    backends = [
        {**backend_view(r, now, mono, settings), "draining": draining} for r, draining in listed
    ]
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
    limit = _count(request.query_params.get("limit", "50"), "limit")
    recorder = runtime_of(request).recorder
    recorder.flush()
    recent = list(recorder.recent)[-limit:] if limit else []
    return JSONResponse({"requests": [r.summary() for r in recent]})


def _count(text: str, param: str) -> int:
    """A query parameter that counts something: ASCII decimal digits only.

    ``str.isdigit`` alone also takes "²" (which ``int`` refuses: a 500) and "١٢" (which it
    reads as 12)."""
    if not (text.isascii() and text.isdigit()):
        raise InvalidRequest(f"{param} must be a non-negative integer", param=param)
    digits = text.lstrip("0") or "0"
    # Past int()'s cap (4300 digits) a count can only mean "all of them".
    return int(digits) if len(digits) <= 18 else sys.maxsize


async def metrics(request: Request) -> Response:
    runtime = runtime_of(request)
    runtime.refresh_gauges()
    body, content_type = render(runtime.metrics_registry, request.headers.get("accept"))
    return Response(body, headers={"content-type": content_type})


ROUTES = [
    *(Route(path, ProxiedEndpoint(), methods=["POST"]) for path in sorted(PROXIED_PATHS)),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/admin/reload", admin_reload, methods=["POST"]),
    Route("/admin/state", admin_state, methods=["GET"]),
    Route("/admin/requests", admin_requests, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
