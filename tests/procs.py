"""Real processes on 127.0.0.1 for tests: simulated backends and gateways.

Every process started here is stopped by its PID, also when a test fails:
by the test's own cleanup, or else by the conftest fixtures that read ``STARTED``
(a backend started just before a gateway that failed to start used to outlive the
run). Readiness is polled (a bounded wait for a condition), never slept for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.raw_sse_backend import MODEL as RAW_MODEL

MODEL = "Qwen/Qwen3-4B"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    condition: Callable[[], bool], timeout: float = 15.0, interval: float = 0.02
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


def _answers(url: str, status: int = 200) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == status
    except httpx.HTTPError:
        return False


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


STARTED: list[Proc] = []
"""Every process :func:`start_process` started in this test run, in order."""


def stop_all_started_since(first: int) -> list[Proc]:
    """Stop the processes started from index ``first`` on that still run; returns them."""
    left = [proc for proc in STARTED[first:] if proc.process.poll() is None]
    for proc in left:
        proc.stop(timeout=5.0)
    return left


def start_process(
    args: list[str],
    url: str,
    ready_path: str,
    log: Path,
    env: dict[str, str] | None = None,
    module: str = "gateway.cli",
) -> Proc:
    handle = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parent.parent,
    )
    proc = Proc(process, url, log)
    STARTED.append(proc)
    try:
        wait_until(lambda: process.poll() is not None or _answers(url + ready_path), timeout=30)
    except TimeoutError:
        proc.kill()
        raise
    if process.poll() is not None:
        raise RuntimeError(f"{args[0]} exited with {process.returncode}:\n{proc.output()}")
    return proc


def start_sim(tmp: Path, *, port: int | None = None, model: str = MODEL, **options: Any) -> Proc:
    port = port or free_port()
    args = ["sim", "--port", str(port), "--model", model]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return start_process(args, f"http://127.0.0.1:{port}", "/health", tmp / f"sim-{port}.log")


def served(proc: Proc) -> Iterator[Proc]:
    """A fixture's body for a process: yield it, stop it afterwards."""
    try:
        yield proc
    finally:
        proc.stop()


def start_raw_sse(tmp: Path) -> Proc:
    """:mod:`tests.raw_sse_backend`: a backend whose every answer is its request's script."""
    port = free_port()
    return start_process(
        ["--port", str(port)],
        f"http://127.0.0.1:{port}",
        "/health",
        tmp / f"raw-{port}.log",
        module="tests.raw_sse_backend",
    )


@dataclass
class Gateway:
    proc: Proc
    config_path: Path
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.proc.url

    def write_config(self, config: dict[str, Any]) -> None:
        self.config = config
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)  # atomic, so a reload never reads half a file

    def state(self, token: str | None = None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.get(self.url + "/admin/state", headers=headers, timeout=5).json()


def start_gateway(tmp: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> Gateway:
    port = free_port()
    config = {**config, "listen": {**config.get("listen", {}), "host": "127.0.0.1", "port": port}}
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start_process(
        ["serve", "--config", str(path), "--log-level", "warning"],
        f"http://127.0.0.1:{port}",
        "/health",
        tmp / f"gateway-{port}.log",
        env,
    )
    return Gateway(proc, path, config)


def served_gateway(tmp: Path, config: dict[str, Any]) -> Iterator[Gateway]:
    """A fixture's body for a gateway: started on ``config``, yielded, stopped afterwards."""
    gateway = start_gateway(tmp, config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


def scripted_config(raw: Proc, read_timeout_s: float = 5, **extra: Any) -> dict[str, Any]:
    """A gateway in front of a scripted backend (``tests.raw_sse_backend``) as its one
    backend ``raw``, whatever the script does: probes that never eject it, one attempt a
    request. ``extra`` adds or replaces top-level keys (``backends`` too)."""
    return {
        "backends": [{"name": "raw", "url": raw.url, "pool": "short", "models": [RAW_MODEL]}],
        "health": {"interval_s": 30, "failure_threshold": 1000},
        "upstream": {"read_timeout_s": read_timeout_s, "max_attempts": 1},
        **extra,
    }


def backend(name: str, url: str, pool: str = "short", **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "pool": pool, "models": [MODEL], **extra}
