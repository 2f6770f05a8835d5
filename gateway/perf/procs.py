"""The benchmark's processes: started pinned to a core, watched through /proc, stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# SCHED_FIFO priority for --realtime: above every ordinary process, far below the kernel's.
RT_PRIORITY = 10


def pinned(command: list[str], core: int | None, realtime: bool = False) -> list[str]:
    """``command`` under ``taskset -c core`` (and ``chrt -f``), which exec it: same PID."""
    if realtime:
        if shutil.which("chrt") is None:
            raise RuntimeError("chrt not found (util-linux); run without --realtime")
        command = ["chrt", "-f", str(RT_PRIORITY), *command]
    if core is None:
        return command
    if shutil.which("taskset") is None:
        raise RuntimeError("taskset not found (util-linux); run with --no-pin")
    return ["taskset", "-c", str(core), *command]


def make_realtime() -> None:
    """This process (the load generator) preempts ordinary processes on its core."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start(
    name: str,
    args: list[str],
    url: str,
    ready_path: str,
    log: Path,
    core: int | None,
    realtime: bool = False,
) -> Proc:
    """Start ``python -m args...`` and wait (bounded) until ``url + ready_path`` answers 200."""
    return start_command(name, [sys.executable, "-m", *args], url, ready_path, log, core, realtime)


def start_command(
    name: str,
    command: list[str],
    url: str,
    ready_path: str,
    log: Path,
    core: int | None,
    realtime: bool = False,
) -> Proc:
    """Start ``command`` and wait (bounded) until ``url + ready_path`` answers 200."""
    handle = log.open("wb")
    process = subprocess.Popen(
        pinned(command, core, realtime),
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )
    proc = Proc(name, process, url, log)
    deadline = time.monotonic() + 30
    while process.poll() is None:
        try:
            if httpx.get(url + ready_path, timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.stop()
            raise TimeoutError(f"{name} not ready within 30 s:\n{proc.output()}")
        time.sleep(0.05)  # polling a readiness condition, bounded by the deadline
    raise RuntimeError(f"{name} exited with {process.returncode}:\n{proc.output()}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def core_busy_seconds() -> dict[int, float]:
    """Busy (non-idle) CPU seconds of each core since boot, from /proc/stat."""
    busy = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(v) for v in values]
            busy[int(name[3:])] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / _TICK
    return busy


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (``None``: this one)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def start_kneecap(args: list[str], port: int, log: Path, procs: list[Proc] | None = None) -> Proc:
    """``kneecap ARGS`` on 127.0.0.1:port, ready (bounded wait); registered in ``procs``."""
    proc = start(
        args[0], ["gateway.cli", *args], f"http://127.0.0.1:{port}", "/health", log, core=None
    )
    if procs is not None:
        procs.append(proc)
    return proc
