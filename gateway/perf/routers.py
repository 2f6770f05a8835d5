"""Other routers run through the relay bench's own load, beside the gateway.

Issue 4's targets come with figures for the field's routers (vllm-router,
sglang-router, LiteLLM), measured on another harness. Run on this one, in the same
run as kneecap, they tell what this harness's floor is for a router that does
its job in compiled code, and so how far kneecap's figures are from it here:

    --router 'vllm-router=vllm-router --host 127.0.0.1 --port {port} --worker-urls {backend}'

The command is split as a shell would split it, then ``{port}`` (where the bench's
clients connect), ``{backend}`` (the fast backend's URL), ``{backend_port}`` (its port)
and ``{metrics_port}`` (a free port, for routers that open a Prometheus port of their
own) are filled in. The router
runs as the gateway does: pinned to the gateway's core, SCHED_FIFO with
``--realtime``, ready once ``GET /v1/models`` through it answers 200.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

from gateway.perf import procs

HOST = "127.0.0.1"
PLACEHOLDERS = ("port", "backend", "backend_port", "metrics_port")
# Names the bench already gives its own processes and phases.
RESERVED = frozenset({"direct", "floor", "gateway", "backend", "loadgen", "tcp-relay"})


@dataclass(frozen=True)
class RouterSpec:
    name: str
    command: tuple[str, ...]  # with placeholders

    def filled(self, port: int, backend: str, metrics_port: int) -> list[str]:
        values = {
            "port": port,
            "backend": backend,
            "backend_port": backend.rsplit(":", 1)[1],
            "metrics_port": metrics_port,
        }
        return [arg.format(**values) for arg in self.command]


def parse_router(text: str) -> RouterSpec:
    """``NAME=COMMAND``: the ``argparse`` type of ``--router``."""
    name, sep, command = text.partition("=")
    name = name.strip()
    if not sep or not name or not command.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND, got {text!r}")
    if name in RESERVED or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(
            f"router name {name!r}: letters, digits, - and _ only, "
            f"and none of {', '.join(sorted(RESERVED))}"
        )
    try:
        words = tuple(shlex.split(command))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"router {name}: {exc}") from None
    try:
        RouterSpec(name, words).filled(port=1, backend="http://127.0.0.1:3", metrics_port=2)
    except (KeyError, IndexError, ValueError) as exc:
        known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
        raise argparse.ArgumentTypeError(
            f"router {name}: bad placeholder {exc} (known: {known}; a literal brace is doubled)"
        ) from None
    if not any("{port}" in word for word in words):
        raise argparse.ArgumentTypeError(f"router {name}: the command must listen on {{port}}")
    return RouterSpec(name, words)


def start_router(
    spec: RouterSpec, backend_url: str, workdir: Path, core: int | None, realtime: bool
) -> procs.Proc:
    port = procs.free_port()
    command = spec.filled(port, backend_url, procs.free_port())
    return procs.start_command(
        spec.name,
        command,
        f"http://{HOST}:{port}",
        "/v1/models",
        workdir / f"router-{spec.name}.log",
        core,
        realtime,
    )
