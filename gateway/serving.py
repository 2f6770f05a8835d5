"""Runs uvicorn servers: the gateway, and the simulated backends it may embed.

The gateway's server owns the signals (Ctrl-C drains it); embedded simulated
backends start first on free loopback ports and stop after the gateway.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import uvicorn
from starlette.types import ASGIApp

from backends.sim.arrival import HTTP_PROTOCOL
from backends.sim.factory import make_engine
from backends.sim.server import create_sim_app
from gateway.drain import STOP_GRACE_S, Drain
from gateway.settings import BackendConfig

log = logging.getLogger("kneecap")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_config(app: ASGIApp, host: str, port: int, **kwargs: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=kwargs.pop("log_level", "warning"),  # type: ignore[arg-type]
        access_log=False,
        proxy_headers=kwargs.pop("proxy_headers", False),  # no server here uses client addresses
        timeout_graceful_shutdown=kwargs.pop("timeout_graceful_shutdown", 10),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def gateway_server(
    app: ASGIApp, host: str, port: int, drain: Drain, log_level: str = "warning"
) -> uvicorn.Server:
    """The gateway's server: its own HTTP protocol, and a graceful shutdown that outlasts
    the drain."""
    from gateway.protocol import GatewayProtocol  # the gateway's alone: sims run stock uvicorn

    config = server_config(
        app,
        host,
        port,
        log_level=log_level,
        http=GatewayProtocol,  # stamps each request's arrival: TTFT starts there
        # uvicorn cancels what still runs only after the drain closed the queues.
        timeout_graceful_shutdown=drain.timeout_s + STOP_GRACE_S,
    )
    return uvicorn.Server(config)


@dataclass
class EmbeddedSim:
    name: str
    url: str
    server: uvicorn.Server


def build_embedded_sims(
    backends: Sequence[BackendConfig], host: str = "127.0.0.1"
) -> list[EmbeddedSim]:
    sims = []
    for backend in backends:
        if backend.sim is None or backend.url is not None:
            continue
        sim = backend.sim
        engine = make_engine(
            model=backend.models[0] if backend.models else "Qwen/Qwen3-4B",
            profile=sim.profile,
            ttft_ms=sim.ttft_ms,
            itl_ms=sim.itl_ms,
            speed=sim.speed,
            seed=sim.seed,
            flavor="sglang" if backend.engine == "sglang" else "vllm",
        )
        port = free_port(host)
        server = uvicorn.Server(
            server_config(
                create_sim_app(engine, backend.models[0] if backend.models else "Qwen/Qwen3-4B"),
                host,
                port,
                http=HTTP_PROTOCOL,  # requests arrive at the engine when their bytes did
            )
        )
        sims.append(EmbeddedSim(backend.name, f"http://{host}:{port}", server))
    return sims


Announce = Callable[[int], None]  # called with the port a server listens on, once it does


def http_url(host: str, port: int) -> str:
    """The base URL a client would use: an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_servers(
    gateway: uvicorn.Server,
    sims: Sequence[EmbeddedSim],
    drain: Drain | None = None,
    announce: Announce | None = None,
) -> None:
    """Serve until stopped, on uvloop when it is installed (as uvicorn's ``loop="auto"``).

    The servers run inside ``anyio.run`` rather than ``uvicorn.Server.run``, so the
    event loop is chosen here; uvloop roughly halves the loop's own cost per
    socket read and write, which is most of what relaying a token costs.
    """
    options = {"use_uvloop": _has_uvloop()}
    anyio.run(serve_with_sims, gateway, sims, drain, announce, backend_options=options)


def run_server(server: uvicorn.Server, announce: Announce) -> None:
    """``server.run()`` (its signal handling included), announcing the bound port."""

    async def serve() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(_announce_when_started, server, announce)
            await server.serve()
            group.cancel_scope.cancel()

    anyio.run(serve, backend_options={"use_uvloop": _has_uvloop()})


async def _announce_when_started(server: uvicorn.Server, announce: Announce) -> None:
    # Only then is the port known (``port: 0`` picks one) and worth printing.
    while not server.started:  # noqa: ASYNC110  (uvicorn offers no "started" event)
        await anyio.sleep(0.01)
    announce(server.servers[0].sockets[0].getsockname()[1])


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


async def serve_with_sims(
    gateway: uvicorn.Server,
    sims: Sequence[EmbeddedSim],
    drain: Drain | None = None,
    announce: Announce | None = None,
) -> None:
    """Sims up first, gateway last; Ctrl-C/SIGTERM drains the gateway, then the sims.

    Signals are handled here rather than by uvicorn, which re-raises them once
    the first server has stopped and would cut the others off mid-shutdown.
    """
    failed: SystemExit | None = None
    async with anyio.create_task_group() as backends:
        for sim in sims:
            backends.start_soon(_serve_then_shut_down, sim.server)
        # uvicorn offers no "started" event to wait on.
        while not all(s.server.started for s in sims):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        async with anyio.create_task_group() as front:
            front.start_soon(_stop_on_signal, gateway, drain or Drain(0.0))
            if announce is not None:
                front.start_soon(_announce_when_started, gateway, announce)
            try:
                await _serve_then_shut_down(gateway)
            except SystemExit as exc:  # uvicorn could not start (it logged why: a port taken)
                failed = exc
            front.cancel_scope.cancel()
        for sim in sims:
            sim.server.should_exit = True
            # A second Ctrl-C stops at once: the sims too, not after their own 10 s grace
            # for the streams the gateway just cut.
            sim.server.force_exit = gateway.force_exit
    if failed is not None:
        raise failed  # once the sims have stopped in order: the exit code, no traceback


async def _serve_then_shut_down(server: uvicorn.Server) -> None:
    await server._serve()
    if server.force_exit and server.started:
        # Forced, uvicorn skips the app's shutdown, whose task was then cancelled at the
        # loop's end with a traceback. It is quick: clients closed, the metrics flushed.
        with anyio.move_on_after(STOP_GRACE_S):
            await server.lifespan.shutdown()


async def _stop_on_signal(gateway: uvicorn.Server, drain: Drain) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as deadline:
            async for signum in signals:
                if gateway.should_exit:  # a second Ctrl-C: stop waiting for open streams
                    drain.stop()
                    # The queued requests' 503s and the cut streams' last events out.
                    await anyio.sleep(STOP_GRACE_S / 10)
                    gateway.force_exit = True
                    continue
                gateway.should_exit = True
                deadline.start_soon(_stop_after, drain)
                # At warning: a gateway run at `--log-level warning` says when it began to
                # refuse new work and why, before its own drain-timeout warning.
                log.warning(
                    "received %s, draining for up to %g s",
                    signal.Signals(signum).name,
                    drain.timeout_s,
                )


async def _stop_after(drain: Drain) -> None:
    await anyio.sleep(drain.timeout_s)
    if not drain.stopped:
        log.warning(
            "drain timeout (%g s): refusing queued requests, ending %d streams",
            drain.timeout_s,
            drain.streams,
        )
    drain.stop()
