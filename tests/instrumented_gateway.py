"""The gateway as ``kneecap serve`` runs it, with what tests must see that it never shows.

Run as ``python -m tests.instrumented_gateway --config PATH --port P --at-exit OUT``, or
through :func:`start_instrumented_gateway`. The same ``create_app`` and server (protocol,
drain, signals) as ``kneecap serve``, plus:

- ``GET /fail``, whose handler raises what no handler expects: the product has no 500
  left for a test to cause, yet how it answers one must be checked for real;
- at exit, once the drain is over and the lifespan has flushed its records, the
  ``/admin/requests`` records and the ``/metrics`` exposition written to ``OUT`` as JSON:
  what the drain's end recorded, which no client can ask for once the gateway stopped
  accepting connections.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import create_app
from gateway.cors import LiveCors
from gateway.drain import Drain
from gateway.metrics import render
from gateway.runtime import Runtime
from gateway.serving import gateway_server, run_servers
from gateway.settings import load_settings
from tests.procs import Proc, free_port, start_process

FAILING_PATH = "/fail"


class UnexpectedFailure(Exception):
    """What the failing route raises: named so that its traceback is found in the log."""


async def fail(request: Request) -> Response:
    raise UnexpectedFailure("a route failed as no handler expects")


def start_instrumented_gateway(
    tmp: Path, config: dict[str, Any], env: dict[str, str] | None = None
) -> tuple[Proc, Path]:
    """The gateway on a free port, and the file it writes at exit (read it once it exited)."""
    port = free_port()
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    at_exit = tmp / f"gateway-{port}-at-exit.json"
    args = ["--config", str(path), "--port", str(port), "--at-exit", str(at_exit)]
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"gateway-{port}.log"
    proc = start_process(args, url, "/health", log, env, module="tests.instrumented_gateway")
    return proc, at_exit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--at-exit", type=Path, required=True)
    args = parser.parse_args()
    settings = load_settings(args.config)
    drain = Drain(settings.listen.drain_timeout_s)
    front = create_app(settings, config_path=args.config, drain=drain)
    cors = front.app  # Front → LiveCors → the Starlette app with the routes
    assert isinstance(cors, LiveCors) and isinstance(cors.app, Starlette)
    cors.app.router.routes.append(Route(FAILING_PATH, fail, methods=["GET"]))
    server = gateway_server(front, "127.0.0.1", args.port, drain)
    run_servers(server, [], drain)
    runtime: Runtime = server.lifespan.state["runtime"]
    runtime.recorder.flush()
    body, _ = render(runtime.metrics_registry)
    requests = [record.summary() for record in runtime.recorder.recent]
    args.at_exit.write_text(json.dumps({"requests": requests, "metrics": body.decode()}))


if __name__ == "__main__":
    main()
