"""Two versions of the gateway on one core, the same load alternated between them in short
slices: what one change costs or saves, with the machine's drift hitting both alike.

    python -m gateway.perf.interleave --old /path/to/old/checkout --scenario nonstream

``--old`` is another checkout of kneecap (e.g. ``git worktree add /tmp/old HEAD~1``);
the new side is this one. ``--old-python`` runs the old side on another interpreter: with
``--old`` this checkout, the two sides differ by interpreter alone. Both gateways run
pinned to core 0 in front of the relay bench's fast backend (core 1, with the load);
slices alternate old/new, new/old, ... On
this shared VM single runs of ``relay_bench`` move by ±30 % between runs, while adjacent
slices see nearly the same machine: the figure to read is the median over slice pairs.

- ``nonstream``: 32 closed-loop clients, ``max_tokens: 1``; requests/s per slice.
- ``paced``: 64 clients, TTFT 50 ms, ITL 15 ms, 128 tokens; per slice the client-side
  TTFT p50 and p99 (a slice holds ~380 requests: its p99 is about its 4th worst), ITL p99
  (~50,000 gaps), and each gateway's own receipt-to-upstream-write p50
  (``/admin/requests``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import yaml

from gateway.perf.backend import MODEL
from gateway.perf.loadgen import Window, build_request, run_client
from gateway.perf.procs import Proc, free_port, pinned, start
from gateway.perf.relay_bench import percentile

HOST = "127.0.0.1"
HERE = Path(__file__).resolve().parents[2]


def _gateway(
    name: str, checkout: Path, python: str, backend_url: str, workdir: Path, core: int | None
) -> Proc:
    port = free_port()
    config = workdir / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": HOST, "port": port},
                "backends": [{"name": "fast-0", "url": backend_url, "models": [MODEL]}],
                "upstream": {"max_connections": 4096},
                "admission": {"limit": {"kind": "static", "initial": 4096, "max": 4096}},
            }
        )
    )
    command = [python, "-m", "gateway.cli", "serve", "--config", str(config)]
    handle = (workdir / f"{name}.log").open("wb")
    process = subprocess.Popen(
        pinned([*command, "--log-level", "warning"], core),
        stdout=handle,
        stderr=handle,
        cwd=checkout,
        env={**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")},
    )
    proc = Proc(name, process, f"http://{HOST}:{port}", workdir / f"{name}.log")
    deadline = time.monotonic() + 30
    while not _answers(proc.url):
        if process.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{name} gateway did not start:\n{proc.output()}")
        time.sleep(0.05)  # polling readiness, bounded by the deadline
    return proc


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _body(scenario: str) -> bytes:
    payload: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    if scenario == "nonstream":
        payload["max_tokens"] = 1
    else:
        payload.update(stream=True, max_tokens=128, perf_ttft_ms=50, perf_itl_ms=15)
    return json.dumps(payload, separators=(",", ":")).encode()


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (``/proc/PID/stat``, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _cpu_at(pid: int, moment: float) -> float:
    await asyncio.sleep(max(0.0, moment - time.perf_counter()))
    return _cpu_seconds(pid)


async def _slice(proc: Proc, scenario: str, body: bytes, seconds: float) -> dict[str, float]:
    url = proc.url
    port = int(url.rsplit(":", 1)[1])
    request = build_request(HOST, port, body)
    clients = 32 if scenario == "nonstream" else 64
    warmup = 0.3 if scenario == "nonstream" else 2.5  # paced: one request's length and more
    now = time.perf_counter()
    window = Window(now + warmup, now + warmup + seconds)

    async def client(index: int) -> None:
        if scenario == "paced":  # spread over one request's length: steady arrivals
            await asyncio.sleep(index * 2.0 / clients)
        await run_client(HOST, port, request, window, window.t1)

    # The gateway's CPU over the counted window: per request, it moves far less with the
    # machine's drift than requests/s does.
    cpu_start = asyncio.create_task(_cpu_at(proc.pid, window.t0))
    cpu_end = asyncio.create_task(_cpu_at(proc.pid, window.t1))
    await asyncio.gather(*(client(i) for i in range(clients)))
    if scenario == "nonstream":
        cpu = await cpu_end - await cpu_start
        return {
            "req_s": window.completed / seconds,
            "cpu_us_per_req": cpu / max(1, window.completed) * 1e6,
        }
    cpu_start.cancel()
    cpu_end.cancel()
    async with httpx.AsyncClient() as client:  # the gateway's own figures, after the slice
        records = (await client.get(url + "/admin/requests?limit=256", timeout=5)).json()
    records = records.get("requests", records) if isinstance(records, dict) else records
    upstream = [r["upstream_s"] for r in records if r.get("upstream_s") is not None]
    return {
        "ttft_p50_ms": statistics.median(window.ttft) * 1000,
        "ttft_p99_ms": _p99(window.ttft) * 1000,
        "itl_p99_ms": _p99(window.itl) * 1000,
        "receipt_to_write_p50_ms": statistics.median(upstream) * 1000,
    }


def _p99(values: list[float]) -> float:
    value = percentile(values, 99)  # nearest rank, as relay_bench reads its own runs
    if value is None:
        raise RuntimeError("a paced slice completed no request")
    return value


async def _run(old: Proc, new: Proc, scenario: str, pairs: int) -> list[dict[str, float]]:
    body = _body(scenario)
    seconds = 2.0 if scenario == "nonstream" else 12.0
    rows = []
    for i in range(pairs):
        order = (old, new) if i % 2 == 0 else (new, old)
        got = {proc.name: await _slice(proc, scenario, body, seconds) for proc in order}
        row = {
            f"{side} {key}": value for side in ("old", "new") for key, value in got[side].items()
        }
        rows.append(row)
        print(f"{i:3d}  " + "  ".join(f"{k} {v:,.3f}" for k, v in row.items()), flush=True)
    return rows


def _summary(rows: list[dict[str, float]], scenario: str) -> str:
    keys = (
        ["req_s", "cpu_us_per_req"]
        if scenario == "nonstream"
        else ["ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "receipt_to_write_p50_ms"]
    )
    lines = []
    for key in keys:
        old = [r[f"old {key}"] for r in rows]
        new = [r[f"new {key}"] for r in rows]
        if scenario == "nonstream":
            ratios = [n / o for o, n in zip(old, new, strict=True)]
            lines.append(
                f"{key}: old mean {statistics.mean(old):,.0f}, "
                f"new mean {statistics.mean(new):,.0f}; "
                f"new/old median {statistics.median(ratios):.3f} "
                f"(pairs {min(ratios):.2f}-{max(ratios):.2f})"
            )
        else:
            deltas = [n - o for o, n in zip(old, new, strict=True)]
            lines.append(
                f"{key}: old mean {statistics.mean(old):.3f}, new mean {statistics.mean(new):.3f}; "
                f"new - old median {statistics.median(deltas):+.3f} ms"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.perf.interleave", description=__doc__)
    parser.add_argument("--old", type=Path, required=True, help="another kneecap checkout")
    parser.add_argument("--scenario", choices=("nonstream", "paced"), default="nonstream")
    parser.add_argument("--pairs", type=int, default=12, help="slice pairs (default 12)")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset/affinity")
    parser.add_argument(
        "--old-python",
        default=sys.executable,
        help="the old side's interpreter, with kneecap's dependencies (default: this one)",
    )
    args = parser.parse_args(argv)
    if not (args.old / "gateway" / "cli.py").exists():
        parser.error(f"--old {args.old}: not a kneecap checkout")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="kneecap-interleave-") as tmp:
        workdir = Path(tmp)
        try:
            backend_port = free_port()
            backend = start(
                "backend",
                ["gateway.perf.backend", "--port", str(backend_port)],
                f"http://{HOST}:{backend_port}",
                "/health",
                workdir / "backend.log",
                core=None if args.no_pin else 1,
            )
            procs.append(backend)
            core = None if args.no_pin else 0
            old = args.old.resolve()
            procs.append(_gateway("old", old, args.old_python, backend.url, workdir, core))
            procs.append(_gateway("new", HERE, sys.executable, backend.url, workdir, core))
            if not args.no_pin:  # the load beside the backend, off the gateways' core
                os.sched_setaffinity(0, {1})
            rows = asyncio.run(_run(procs[1], procs[2], args.scenario, args.pairs))
            print(_summary(rows, args.scenario))
        finally:
            for proc in reversed(procs):
                proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
