"""``create_app(settings)``: everything shared by requests is built in the lifespan."""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Mapping
from functools import partial
from http.cookiejar import DefaultCookiePolicy
from pathlib import Path

import anyio
import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from backends.health import HealthProber, probe_all
from backends.scrape import scrape_loop
from gateway.background import keep_running
from gateway.config_watch import watch_config_file
from gateway.cors import LiveCors
from gateway.drain import DRAIN_STATE_KEY, Drain
from gateway.errors import (
    GatewayError,
    InternalError,
    NotFound,
    error_body,
    openai_error_response,
)
from gateway.front import Front
from gateway.metrics import GatewayMetrics
from gateway.middleware import REQUEST_ID_SCOPE_KEY, RequestIdMiddleware
from gateway.pacer import Pacer
from gateway.recording import SETTLE_S, Recorder
from gateway.routes import ROUTES
from gateway.runtime import Runtime, Snapshot
from gateway.settings import Settings
from gateway.upstream import UpstreamTransport

log = logging.getLogger("kneecap")


def upstream_timeout(settings: Settings) -> httpx.Timeout:
    upstream = settings.upstream
    return httpx.Timeout(
        connect=upstream.connect_timeout_s,
        read=upstream.read_timeout_s,
        write=upstream.read_timeout_s,
        pool=upstream.connect_timeout_s,
    )


def build_transport(settings: Settings) -> UpstreamTransport:
    """kneecap's own keep-alive transport for plain HTTP: httpx's default one spends
    most of the relay's CPU on pool bookkeeping and pure-Python parsing (see
    ``gateway/upstream.py``); ``https://`` goes to httpx's transport unchanged."""
    return UpstreamTransport(max_connections=settings.upstream_connections)


def own_connections(settings: Settings) -> int:
    """The bound of the pool for the gateway's own calls: each round of health probes and
    each of engine scrapes calls every backend once, so two per backend at most."""
    return 2 * max(1, len(settings.backends))


def build_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """A client for calls the gateway makes through the client layer: health probes and
    /metrics scrapes (on a transport of their own), ``/tokenize`` (on the traffic's).

    Shared by many callers, so it must never store a backend's ``Set-Cookie`` and
    replay it: its cookie policy accepts none. Proxied requests skip the client
    layer and go straight to the transport.
    """
    client = httpx.AsyncClient(
        timeout=upstream_timeout(settings),
        limits=httpx.Limits(
            max_connections=settings.upstream_connections,
            max_keepalive_connections=settings.upstream_connections,
        ),
        transport=transport or build_transport(settings),
        trust_env=False,
    )
    client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))
    return client


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return openai_error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return openai_error_response(NotFound(f"no route for {request.url.path}"))
    code = "method_not_allowed" if exc.status_code == 405 else None
    body = error_body(str(exc.detail), "invalid_request_error", None, code)
    # A 405 names the allowed methods (RFC 9110 §15.5.6); Starlette puts them in headers.
    return Response(
        body, status_code=exc.status_code, media_type="application/json", headers=exc.headers
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Starlette's answer to what a route did not expect, in the shape of the proxied
    endpoints' (``gateway/front.py``); Starlette re-raises, so it is logged with its
    traceback. Its middleware runs outside the request id's, so the id is put back here."""
    request_id = request.scope.get(REQUEST_ID_SCOPE_KEY)
    error = InternalError(headers={"x-request-id": request_id} if request_id else None)
    return openai_error_response(error)


def _keep_out_of_full_collections() -> None:
    """What start-up built (modules, settings, clients, metrics) lives as long as the
    gateway: the collector's full passes need not walk it again. Walked, a full pass took
    59 ms (traced under the relay bench's paced load, quiet machine; 3.3 ms frozen), a
    pause every stream and every waiting request took at once.
    """
    gc.collect()
    gc.freeze()


def create_app(
    settings: Settings,
    *,
    config_path: str | Path | None = None,
    sim_urls: Mapping[str, str] | None = None,
    drain: Drain | None = None,
) -> Front:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Runtime | Drain | None]]:
        # Two pools. The traffic's is bounded by ``upstream.max_connections`` and also
        # carries /tokenize, which requests cause (and which may fall back to an estimate):
        # the more requests, the more of it. Probes and scrapes get their own, so a pool
        # full of streams can never make a busy, healthy backend look dead.
        transport = build_transport(settings)
        client = build_client(settings, transport)
        own_transport = UpstreamTransport(max_connections=own_connections(settings))
        own_client = build_client(settings, own_transport)
        urls = dict(sim_urls or {})
        registry = CollectorRegistry()
        runtime = Runtime(
            current=Snapshot.build(settings, None, urls),
            client=client,
            transport=transport,
            recorder=Recorder(GatewayMetrics(registry), settle_s=SETTLE_S),
            metrics_registry=registry,
            config_path=Path(config_path) if config_path else None,
            sim_urls=urls,
        )

        def health_view():
            snapshot = runtime.current
            return snapshot.backends, snapshot.settings.health

        def scrape_view():
            snapshot = runtime.current
            return snapshot.backends, snapshot.settings.measurement.scrape_interval_s

        def close_admissions() -> None:
            for admission in runtime.admissions.values():
                admission.close()

        if drain is not None:
            drain.on_stop(close_admissions)
        count_ejection = runtime.metrics.observe_ejection
        prober = HealthProber(own_client, health_view, runtime.notify, count_ejection)
        scrape_pacer = Pacer(lambda: runtime.current.settings.measurement.scrape_interval_s)
        control_pacer = Pacer(lambda: runtime.current.settings.admission.control_interval_s)

        def on_reload() -> None:
            live = runtime.current.settings
            transport.resize(live.upstream_connections)
            own_transport.resize(own_connections(live))
            prober.probe_soon()  # new replicas are probed now, not a full interval later
            scrape_pacer.wake()  # a changed interval applies now, not after the old one
            control_pacer.wake()

        runtime.on_reload = on_reload
        # One probe round before serving, so /ready and routing start informed.
        await probe_all(
            own_client,
            runtime.current.backends,
            settings.health,
            runtime.notify,
            on_ejection=count_ejection,
        )
        try:
            async with anyio.create_task_group() as group:
                scrape = partial(scrape_loop, own_client, scrape_view, scrape_pacer.sleep)
                control = partial(control_loop, runtime, control_pacer)
                group.start_soon(keep_running, "health prober", prober.run)
                group.start_soon(keep_running, "engine scraper", scrape)
                group.start_soon(keep_running, "limit control", control)
                if runtime.config_path:
                    watch = partial(watch_config_file, runtime)
                    group.start_soon(keep_running, "config watcher", watch)
                _install_sighup(runtime)
                _keep_out_of_full_collections()
                try:
                    # The drain reaches the streams through each request's state: it cuts them.
                    yield {"runtime": runtime, DRAIN_STATE_KEY: drain}
                finally:
                    close_admissions()
                    group.cancel_scope.cancel()
        finally:
            # Closed once the loops have ended: a probe between two of its requests when
            # the cancel came would otherwise find its client closed, and log a traceback.
            with anyio.CancelScope(shield=True):
                await client.aclose()
                await own_client.aclose()
            runtime.recorder.flush()

    return Front(
        LiveCors(
            Starlette(
                routes=ROUTES,
                middleware=[Middleware(RequestIdMiddleware)],
                exception_handlers={
                    GatewayError: _gateway_error,
                    HTTPException: _http_error,
                    Exception: _internal_error,
                },
                lifespan=lifespan,
            )
        )
    )


async def control_loop(runtime: Runtime, pacer: Pacer) -> None:
    while True:
        await pacer.sleep()
        runtime.control_tick()


def _install_sighup(runtime: Runtime) -> None:
    def reload_on_signal() -> None:
        # Not ``runtime.reload`` itself: an exception from a handler is logged by asyncio
        # with the callback's repr, and that is the whole runtime.
        try:
            runtime.reload()
        except Exception as exc:
            log.error("SIGHUP reload failed: %s: %s", type(exc).__name__, exc)

    try:
        import asyncio

        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_on_signal)
    except (RuntimeError, NotImplementedError, ValueError):
        log.debug("SIGHUP reload unavailable here (not the main thread)")
