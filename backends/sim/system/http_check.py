"""The same claim through the real HTTP path: gateway + ``kneecap sim --speed K``.

    python -m backends.sim.system.http_check [--speed 3] [--initial 4] [--seconds 240]

Starts a simulated backend (``qwen3-4b/l40s/bf16/vllm`` running K times faster
than real time) and a gateway in front of it with the knee controller, every
time constant divided by K (SLOs, window, control tick, scrape, settle,
smoothing, queue deadline) and the ramp multiplied by K, so that one wall
second is K simulated seconds. 128 closed-loop clients stream 1,024-token
prompts with 2,816-token outputs (ignore_eos) through it; the limit is read
from ``GET /admin/state`` every tick. Then the virtual-time simulation of the
same setup runs, and both are printed side by side in simulated seconds.

Client-side split of each request: queue wait = until the gateway's response
headers (sent once a backend was chosen and answered), TTFT = from there to
the first byte of output. Keep K x tokens/s well under what one Python process
can consume (~15k events/s): ~1,200 tok/s x 3 here. Processes are stopped by
PID whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from backends.sim.system.acceptance import BAND, CLIENTS, PROFILE, SHAPE, SLO_S, SWING, knee
from backends.sim.system.load import ClosedLoop
from backends.sim.system.report import fmt, limit_trace, outcome, pct, settling
from backends.sim.system.sim import BackendSpec, SystemSim
from backends.sim.tokenizer import CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_REPLY, text_of_tokens
from gateway.perf.procs import Proc, free_port
from gateway.perf.procs import start_kneecap as start
from gateway.settings import Settings

MODEL = "Qwen/Qwen3-4B"
_OUTPUT = re.compile(rb'"content":"[^"]')
QUEUE_WAIT_S = 30.0  # the pool's default queue deadline, in simulated seconds
_WRITTEN = "http11.send_request_body.complete"  # httpcore trace events
_HEADERS = "http11.receive_response_headers.complete"
ROOT = Path(__file__).resolve().parents[3]


def gateway_config(sim_url: str, speed: float, initial: int, port: int) -> dict:
    """The gateway's defaults and the knee's, every time constant divided by K."""
    k = speed
    limit = knee(initial).model_dump()
    limit.update(
        ttft_p95_slo=limit["ttft_p95_slo"] / k,
        itl_p95_slo=limit["itl_p95_slo"] / k,
        settle_s=limit["settle_s"] / k,
        knee_smoothing_s=limit["knee_smoothing_s"] / k,
        ceiling_ttl_s=limit["ceiling_ttl_s"] / k,
        ramp_per_s=limit["ramp_per_s"] * k,
    )
    config: dict = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [
            {"name": "sim-0", "url": sim_url, "pool": "short", "models": [MODEL], "limit": limit}
        ],
        "pools": {"short": {"max_queue_depth": 256, "max_queue_wait_s": QUEUE_WAIT_S / k}},
        "admission": {"control_interval_s": 1 / k},
        "measurement": {"window_s": 5 / k, "scrape_interval_s": 1 / k, "scrape_staleness_s": 5 / k},
        "health": {"interval_s": 2 / k},
        "upstream": {"read_timeout_s": 120, "max_connections": 1024},
    }
    if "routing" in Settings.model_fields:
        # Token-budget admission (the routing issue) is not part of this comparison.
        config["routing"] = {"token_budget": {"enabled": False}}
    return config


@dataclass
class Measured:
    queue_waits: list[tuple[float, float]] = field(default_factory=list)  # (admitted, wait)
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (admitted, ttft)
    shed: int = 0
    errors: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    shed_late: list[tuple[float, float]] = field(default_factory=list)  # (sent, wall s late)
    # The same sheds timed on the wire: from the request's last byte written to the
    # response headers read (httpcore's trace), which leaves out this client's own
    # delay in getting the request onto a connection.
    shed_late_wire: list[float] = field(default_factory=list)
    client_lag: float = 0.0  # worst stall of this process's own event loop (wall s)
    limits: list[tuple[float, int, int, int]] = field(default_factory=list)
    kv_usages: list[float | None] = field(default_factory=list)  # scraped, as the knee sees it
    windows: list[tuple[float, float | None, float | None, float | None, float]] = field(
        default_factory=list
    )  # (t, window p95 TTFT, p95 ITL, engine waiting, tok/s), as the controller saw them


async def client_loop(
    http: httpx.AsyncClient, url: str, body: dict, m: Measured, speed: float, stop: float, t0: float
) -> None:
    stamps: dict[str, float] = {}

    async def trace(event: str, info: dict) -> None:
        del info
        if event in (_WRITTEN, _HEADERS):
            stamps[event] = time.monotonic()

    while time.monotonic() < stop:
        sent = time.monotonic()
        stamps.clear()
        try:
            async with http.stream("POST", url, json=body, extensions={"trace": trace}) as r:
                m.statuses[r.status_code] += 1
                if r.status_code != 200:
                    body_bytes = await r.aread()
                    if r.status_code == 429:
                        m.shed += 1
                        if b"queue_timeout" in body_bytes:  # answered when, past its deadline?
                            wait = QUEUE_WAIT_S / speed
                            late = time.monotonic() - sent - wait
                            m.shed_late.append(((sent - t0) * speed, late))
                            if _WRITTEN in stamps and _HEADERS in stamps:
                                wire = stamps[_HEADERS] - stamps[_WRITTEN] - wait
                                m.shed_late_wire.append(wire)
                    await asyncio.sleep(1 / speed)
                    continue
                headers = time.monotonic()
                first = None
                async for chunk in r.aiter_raw():
                    if first is None and _OUTPUT.search(chunk):
                        first = time.monotonic()
                    if time.monotonic() >= stop:
                        break
                admitted = (headers - t0) * speed
                m.queue_waits.append((admitted, (headers - sent) * speed))
                if first is not None:
                    m.ttfts.append((admitted, (first - headers) * speed))
        except httpx.HTTPError:
            m.errors += 1
            await asyncio.sleep(1 / speed)


async def heartbeat(m: Measured, stop: float) -> None:
    """This client's own stalls: a late 429 may be late here, not in the gateway."""
    while time.monotonic() < stop:
        before = time.monotonic()
        await asyncio.sleep(0.01)
        m.client_lag = max(m.client_lag, time.monotonic() - before - 0.01)


async def poll_state(url: str, m: Measured, speed: float, stop: float, t0: float) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < stop:
            tick = time.monotonic()
            try:
                state = (await http.get(url + "/admin/state")).json()
            except httpx.HTTPError:
                continue  # a busy host: the next tick will tell
            b = state["backends"][0]
            depth = state["pools"]["short"]["queue_depth"]
            t = (tick - t0) * speed
            m.limits.append((t, b["limit"], b["in_flight"], depth))
            w, engine = b["window"], b["engine"] or {}
            scale = [None if v is None else v * speed for v in (w["ttft_p95"], w["itl_p95"])]
            tokens = w["output_tokens_per_s"] / speed
            m.windows.append((t, *scale, engine.get("waiting"), tokens))
            m.kv_usages.append(engine.get("kv_usage"))
            await asyncio.sleep(max(0.0, 1 / speed - (time.monotonic() - tick)))


async def drive(gateway: str, speed: float, seconds: float) -> Measured:
    m = Measured()
    content = text_of_tokens(SHAPE.prompt_tokens - CHAT_TOKENS_PER_MESSAGE - CHAT_TOKENS_PER_REPLY)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": SHAPE.output_tokens,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    stop = t0 + seconds / speed
    # One connection per client, each in its own pool: httpcore's pool reassigns every
    # queued request to every connection on each request start and end, so one pool of
    # 128 busy connections spends seconds of this process's CPU on a wave of 128
    # simultaneous requests -- delay that is the client's, and that the queue-timeout
    # lateness measured from the send would otherwise count.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(60.0, connect=10.0)
    url = gateway + "/v1/chat/completions"
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=timeout))
            for _ in range(CLIENTS)
        ]
        tasks = [client_loop(http, url, body, m, speed, stop, t0) for http in clients]
        await asyncio.gather(heartbeat(m, stop), poll_state(gateway, m, speed, stop, t0), *tasks)
    return m


def virtual(initial: int, seconds: float) -> SystemSim:
    sim = SystemSim([BackendSpec("b0", PROFILE)], limit=knee(initial), ttft_slo_s=SLO_S)
    ClosedLoop(sim, CLIENTS, SHAPE)
    sim.run(seconds)
    return sim


def every_10s(points: list[tuple[float, int]], seconds: float) -> list[int]:
    out = []
    for t in range(10, int(seconds) + 1, 10):
        before = [limit for at, limit in points if at <= t]
        out.append(before[-1] if before else 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=3.0)
    parser.add_argument("--initial", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=240.0, help="simulated seconds")
    args = parser.parse_args(argv)
    k = args.speed
    with tempfile.TemporaryDirectory(prefix="kneecap-http-check-") as tmp:
        tmpdir = Path(tmp)
        procs: list[Proc] = []
        try:
            sim_port, gw_port = free_port(), free_port()
            sim_args = ["sim", "--port", str(sim_port), "--model", MODEL, "--profile", PROFILE]
            sim = start([*sim_args, "--speed", str(k)], sim_port, tmpdir / "sim.log")
            procs.append(sim)
            config = tmpdir / "gateway.yaml"
            config.write_text(yaml.safe_dump(gateway_config(sim.url, k, args.initial, gw_port)))
            gw_args = ["serve", "--config", str(config), "--log-level", "warning"]
            procs.append(start(gw_args, gw_port, tmpdir / "gateway.log"))
            started = time.monotonic()
            measured = asyncio.run(drive(procs[-1].url, k, args.seconds))
            wall = time.monotonic() - started
        finally:
            for proc in reversed(procs):
                proc.stop()
    sim_run = virtual(args.initial, args.seconds)
    report(args, measured, sim_run, wall)
    return 0


def report(args: argparse.Namespace, m: Measured, sim: SystemSim, wall: float) -> None:
    seconds = args.seconds
    http_trace = every_10s([(t, limit) for t, limit, _, _ in m.limits], seconds)
    virt = limit_trace(sim)
    virt_trace = [virt[t - 1] for t in range(10, int(seconds) + 1, 10)]
    http_settle = settling(
        every_second([(t, limit) for t, limit, _, _ in m.limits], seconds), *BAND, SWING
    )
    virt_settle = settling(virt, *BAND, SWING)
    half = seconds / 2
    http_ttft = pct([v for t, v in m.ttfts if t >= half], 95)
    http_wait = pct([v for t, v in m.queue_waits if t >= half], 95)
    o = outcome(sim, half, seconds)
    print(f"# HTTP path vs virtual time: {PROFILE}, speed {args.speed:g}x, from {args.initial}\n")
    lates = [v * 1000 for _, v in m.shed_late]
    wire = [v * 1000 for v in m.shed_late_wire]
    print(
        f"({wall:.0f} s of wall time for {seconds:.0f} simulated s; shed {m.shed}, "
        f"client errors {m.errors})\n\nQueue timeouts answered past their deadline (wall ms), "
        f"from the client's send: p50 {fmt(pct(lates, 50), '', 0)}, "
        f"p95 {fmt(pct(lates, 95), '', 0)}, max {fmt(max(lates, default=None), '', 0)} "
        f"(of {len(lates)}); from the request written to the response headers read: "
        f"p50 {fmt(pct(wire, 50), '', 0)}, p95 {fmt(pct(wire, 95), '', 0)}, "
        f"max {fmt(max(wire, default=None), '', 0)}; this client's own event loop stalled up "
        f"to {m.client_lag * 1000:,.0f} ms. The gateway counts a deadline from the request's "
        f"arrival; the first figure also holds this client's delay in getting the request "
        f"onto a connection.\n"
    )
    print("| | settled at | median | band after | p95 TTFT (2nd half) | p95 queue wait |")
    print("|---|---:|---:|---|---:|---:|")
    for name, s, ttft, wait in (
        ("HTTP", http_settle, http_ttft, http_wait),
        ("virtual", virt_settle, o.ttft_p95, o.wait_p95),
    ):
        at = "never" if s.at is None else f"{s.at:.0f} s"
        print(
            f"| {name} | {at} | {s.median:.0f} | {s.low}-{s.high} | {fmt(ttft, ' s')} "
            f"| {fmt(wait, ' s', 1)} |"
        )
    print("\nLimit every 10 simulated s:\n")
    print("- HTTP:    " + " ".join(str(x) for x in http_trace))
    print("- virtual: " + " ".join(str(x) for x in virt_trace))
    # What the controllers were fed: a stream's time per token, y = in_flight / tok/s.
    pairs = zip(m.limits, m.windows, strict=True)
    http_y = every_10s(
        [(w[0], round(1000 * lim[2] / w[4]) if w[4] else 0) for lim, w in pairs], seconds
    )
    virt_y = [
        round(1000 * p.in_flight / p.sample.output_tokens_per_s)
        if p.sample.output_tokens_per_s
        else 0
        for p in (sim.intervals[t - 1].backends[0] for t in range(10, int(seconds) + 1, 10))
    ]
    print("\nms per token per stream (in flight / tok/s) every 10 simulated s:\n")
    print("- HTTP:    " + " ".join(str(x) for x in http_y))
    print("- virtual: " + " ".join(str(x) for x in virt_y))
    seen = [u for u in m.kv_usages if u is not None]
    print(
        f"\nEngine KV cache usage the controller was fed: {len(seen)} of {len(m.kv_usages)} "
        "ticks" + (f", {min(seen):.2f}-{max(seen):.2f}" if seen else "")
    )
    if m.limits:
        medians = statistics.median(x for t, x, _, _ in m.limits if t >= half)
        print(f"\nHTTP limit median over the second half: {medians:.0f}")
    breaches = [
        (t, ttft, itl)
        for t, ttft, itl, _, _ in m.windows
        if (ttft or 0) > SLO_S or (itl or 0) > knee(4).itl_p95_slo
    ]
    print(
        f"Windows breaching the SLO as the HTTP gateway measured them (simulated s): "
        f"{len(breaches)} of {len(m.windows)}"
        + (f", first at {breaches[0][0]:.0f} s" if breaches else "")
    )


def every_second(points: list[tuple[float, int]], seconds: float) -> list[int]:
    out = []
    last = points[0][1] if points else 0
    i = 0
    for t in range(1, int(seconds) + 1):
        while i < len(points) and points[i][0] <= t:
            last = points[i][1]
            i += 1
        out.append(last)
    return out


if __name__ == "__main__":
    sys.exit(main())
