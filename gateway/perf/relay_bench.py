"""The relay benchmark: the same load directly at a fast backend and through the gateway.

    python -m gateway.perf.relay_bench [--scenario NAME ...] [--duration S] [--json FILE]

One run starts a zero-latency raw-socket backend (:mod:`gateway.perf.backend`)
and the gateway (``python -m gateway.cli serve``) as real processes, the
gateway pinned to core 0 with ``taskset``, the backend and this load generator
to core 1, then runs each scenario twice, direct and through the gateway, and
prints both side by side with ratios, deltas, the targets and the CPU each
process used (so a saturated load generator or backend would show).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.perf import loadgen, procs
from gateway.perf.backend import MODEL
from gateway.perf.backend import run as run_loop
from gateway.perf.routers import parse_router, start_router

SCENARIOS = ("nonstream", "stream", "paced", "idle", "hold")
HOST = "127.0.0.1"
HOLD_OPEN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Plan:
    """Load shapes; ``quick`` shrinks them for a smoke test (figures then mean nothing)."""

    duration: float
    warmup: float
    nonstream_clients: int = 32
    stream_clients: int = 32
    stream_tokens: int = 256
    paced_clients: int = 64
    paced_tokens: int = 128
    paced_ttft_ms: float = 50.0
    paced_itl_ms: float = 15.0
    hold_streams: int = 2000

    @property
    def paced_request_s(self) -> float:
        return (self.paced_ttft_ms + (self.paced_tokens - 1) * self.paced_itl_ms) / 1000

    @classmethod
    def quick(cls, duration: float) -> Plan:
        return cls(
            duration=duration,
            warmup=0.2,
            nonstream_clients=4,
            stream_clients=4,
            stream_tokens=16,
            paced_clients=4,
            paced_tokens=8,
            hold_streams=20,
        )


@dataclass
class Row:
    scenario: str
    figure: str
    direct: float | None
    gateway: float
    change: str  # "0.31x" or "+0.42 ms"
    target: str
    met: bool | None


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def body(**fields: Any) -> bytes:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(payload, separators=(",", ":")).encode()


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


@dataclass
class Stack:
    backend: procs.Proc
    gateway: procs.Proc
    floor: procs.Proc  # a bare TCP forwarder on the gateway's core: what any hop costs
    routers: dict[str, procs.Proc] = field(default_factory=dict)  # --router, by name

    def proc(self, target: str) -> procs.Proc:
        own = {"direct": self.backend, "floor": self.floor, "gateway": self.gateway}
        return own[target] if target in own else self.routers[target]

    def port(self, target: str) -> int:
        return int(self.proc(target).url.rsplit(":", 1)[1])


async def _phase(
    stack: Stack,
    target: str,
    request_body: bytes,
    *,
    clients: int,
    warmup: float,
    duration: float,
    stagger: float = 0.0,
) -> dict[str, Any]:
    port = stack.port(target)
    request = loadgen.build_request(HOST, port, request_body)
    watched = {"gateway": stack.gateway, "backend": stack.backend}
    if target == "floor":
        watched["tcp-relay"] = stack.floor
    elif target in stack.routers:
        watched[target] = stack.routers[target]
    start = time.perf_counter()
    t0, t1 = start + warmup, start + warmup + duration
    cpu: dict[str, float] = {}

    def sample() -> dict[str, float]:
        figures = {k: p.cpu_s() for k, p in watched.items()} | {"loadgen": procs.cpu_seconds()}
        figures |= {f"core{core}": busy for core, busy in procs.core_busy_seconds().items()}
        return figures

    async def watch() -> None:
        # Process CPU shows who saturates; core busy minus our processes is other load.
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        before, began = sample(), time.perf_counter()
        await asyncio.sleep(max(0.0, t1 - time.perf_counter()))
        after, elapsed = sample(), time.perf_counter() - began
        cpu.update({k: 100 * (after[k] - before[k]) / elapsed for k in after})

    window = loadgen.Window(t0=t0, t1=t1)
    gap = stagger / clients if stagger else 0.0

    async def client(index: int) -> None:
        if gap:
            await asyncio.sleep(index * gap)  # spread arrivals evenly, no synchronised waves
        await loadgen.run_client(HOST, port, request, window, t1)

    await asyncio.gather(watch(), *(client(i) for i in range(clients)))
    return {
        "clients": clients,
        "duration_s": duration,
        "requests": window.completed,
        "errors": window.errors,
        "error_causes": window.statuses,
        "req_per_s": window.completed / duration,
        "events_per_s": window.events / duration,
        "ttft_p50_ms": ms(percentile(window.ttft, 50)),
        "ttft_p99_ms": ms(percentile(window.ttft, 99)),
        "itl_p50_ms": ms(percentile(window.itl, 50)),
        "itl_p99_ms": ms(percentile(window.itl, 99)),
        "latency_p50_ms": ms(percentile(window.latency, 50)),
        "latency_p99_ms": ms(percentile(window.latency, 99)),
        "samples": len(window.ttft) or len(window.latency),
        "cpu_percent": cpu,
    }


def _both(stack: Stack, name: str, report: Report, **kwargs: Any) -> tuple[dict, dict]:
    direct = run_loop(_phase(stack, "direct", **kwargs))
    through = run_loop(_phase(stack, "gateway", **kwargs))
    report.phases[name] = {"direct": direct, "gateway": through}
    return direct, through


def _floor(stack: Stack, name: str, report: Report, **kwargs: Any) -> dict:
    floor = run_loop(_phase(stack, "floor", **kwargs))
    report.phases[name]["floor"] = floor
    return floor


def _through_routers(stack: Stack, name: str, report: Report, **kwargs: Any) -> dict[str, dict]:
    """The same load through each ``--router``, after the gateway's phase."""
    phases = {}
    for router in stack.routers:
        phases[router] = run_loop(_phase(stack, router, **kwargs))
        report.phases[name][router] = phases[router]
    return phases


def _ratio(direct: float, gateway: float) -> str:
    return f"{gateway / direct:.2f}x" if direct else "-"


def _added(direct: float | None, gateway: float | None) -> float | None:
    return None if direct is None or gateway is None else gateway - direct


def run_nonstream(stack: Stack, plan: Plan, report: Report) -> None:
    load: dict[str, Any] = {
        "request_body": body(max_tokens=1),
        "clients": plan.nonstream_clients,
        "warmup": plan.warmup,
        "duration": plan.duration,
    }
    direct, through = _both(stack, "nonstream", report, **load)
    label = f"(a) non-streaming, {plan.nonstream_clients} clients"
    d, g = direct["req_per_s"], through["req_per_s"]
    report.rows.append(Row(label, "req/s", d, g, _ratio(d, g), ">= 3,000", g >= 3000))
    report.rows.append(_per_core(label, "req/s per gateway CPU-second", g, through))
    d, g = direct["latency_p50_ms"], through["latency_p50_ms"]
    if d is not None and g is not None:
        report.rows.append(Row(label, "latency p50 ms", d, g, f"+{g - d:.2f} ms", "", None))
    for router, phase in _through_routers(stack, "nonstream", report, **load).items():
        d, r = direct["req_per_s"], phase["req_per_s"]
        report.rows.append(Row(label, f"req/s via {router}", d, r, _ratio(d, r), "", None))
        report.rows.append(_per_core(label, f"req/s per {router} CPU-second", r, phase, router))


def run_stream(stack: Stack, plan: Plan, report: Report) -> None:
    load: dict[str, Any] = {
        "request_body": body(max_tokens=plan.stream_tokens, stream=True),
        "clients": plan.stream_clients,
        "warmup": plan.warmup,
        "duration": plan.duration,
    }
    direct, through = _both(stack, "stream", report, **load)
    label = f"(b) streaming {plan.stream_tokens} tokens, {plan.stream_clients} clients"
    d, g = direct["events_per_s"], through["events_per_s"]
    report.rows.append(Row(label, "relayed chunks/s", d, g, _ratio(d, g), ">= 40,000", g >= 40000))
    report.rows.append(_per_core(label, "chunks/s per gateway CPU-second", g, through))
    d, g = direct["req_per_s"], through["req_per_s"]
    report.rows.append(Row(label, "streams/s", d, g, _ratio(d, g), "", None))
    for router, phase in _through_routers(stack, "stream", report, **load).items():
        d, r = direct["events_per_s"], phase["events_per_s"]
        figure = f"relayed chunks/s via {router}"
        report.rows.append(Row(label, figure, d, r, _ratio(d, r), "", None))
        figure = f"chunks/s per {router} CPU-second"
        report.rows.append(_per_core(label, figure, r, phase, router))


def _per_core(
    label: str, figure: str, rate: float, phase: dict[str, Any], relay: str = "gateway"
) -> Row:
    """The rate divided by the share of its core the relay (the gateway, or a router) got:
    what one core sustains.

    Other processes on the gateway's core take CPU the gateway would have used;
    dividing by the gateway's own CPU share makes runs on a busy machine comparable.
    """
    share = phase["cpu_percent"].get(relay, 0.0) / 100
    return Row(label, figure, None, rate / share if share else 0.0, f"at {share:.0%} CPU", "", None)


def run_paced(stack: Stack, plan: Plan, report: Report) -> None:
    request_s = plan.paced_request_s
    load: dict[str, Any] = {
        "request_body": body(
            max_tokens=plan.paced_tokens,
            stream=True,
            perf_ttft_ms=plan.paced_ttft_ms,
            perf_itl_ms=plan.paced_itl_ms,
        ),
        "clients": plan.paced_clients,
        "warmup": max(plan.warmup, 1.3 * request_s),
        "duration": max(2 * plan.duration, 2 * request_s),
        "stagger": request_s,
    }
    direct, through = _both(stack, "paced", report, **load)
    presend = _presend(stack)
    floor = _floor(stack, "paced", report, **load)
    routed = _through_routers(stack, "paced", report, **load)
    label = (
        f"(c) paced TTFT {plan.paced_ttft_ms:g} ms ITL {plan.paced_itl_ms:g} ms "
        f"{plan.paced_tokens} tokens, {plan.paced_clients} clients"
    )
    for figure, key, limit in (
        ("TTFT p50 ms", "ttft_p50_ms", 0.5),
        ("TTFT p99 ms", "ttft_p99_ms", 2.0),
        ("ITL p50 ms", "itl_p50_ms", None),
        ("ITL p99 ms", "itl_p99_ms", 0.5),
    ):
        d, g = direct[key], through[key]
        added = _added(d, g)
        if added is None:
            continue
        target = f"added <= {limit:g} ms" if limit is not None else ""
        met = None if limit is None else added <= limit
        report.rows.append(Row(label, figure, d, g, f"{added:+.2f} ms", target, met))
        hop = _added(d, floor[key])
        if limit is not None and hop is not None:
            hop_figure = f"{figure} via bare TCP hop"
            report.rows.append(Row(label, hop_figure, d, floor[key], f"{hop:+.2f} ms", "", None))
        for router, phase in routed.items():
            added = _added(d, phase[key])
            if limit is not None and added is not None:
                via = f"{figure} via {router}"
                report.rows.append(Row(label, via, d, phase[key], f"{added:+.2f} ms", "", None))
    if presend is not None:
        p50, p90 = presend
        figure = "receipt to upstream write p50 ms, gateway's own clock"
        report.rows.append(Row(label, figure, None, p50, f"p90 {p90:.2f}", "", None))


def run_idle(
    stack: Stack,
    plan: Plan,
    report: Report,
    idle_at_start: float,
    routers_idle: dict[str, float],
) -> None:
    del plan
    label = "(d) idle gateway"
    report.rows.append(
        Row(label, "RSS MB at start", None, idle_at_start, "", "<= 80 MB", idle_at_start <= 80)
    )
    now = stack.gateway.rss_mb()
    report.rows.append(Row(label, "RSS MB now (after load)", None, now, "", "", None))
    for router, rss in routers_idle.items():
        report.rows.append(Row(label, f"RSS MB at start, {router}", None, rss, "", "", None))


async def _hold(stack: Stack, plan: Plan) -> dict[str, Any]:
    port = stack.port("gateway")
    request = loadgen.build_request(
        HOST,
        port,
        body(max_tokens=1_000_000, stream=True, perf_ttft_ms=0, perf_itl_ms=1000),
    )
    window = loadgen.hold_window(plan.hold_streams)
    protocols: list[loadgen.ClientProtocol] = []
    started = time.perf_counter()
    try:
        async with asyncio.timeout(HOLD_OPEN_TIMEOUT_S):
            await loadgen.open_streams(HOST, port, request, window, protocols)
    except TimeoutError:
        pass  # reported: fewer streams open than asked for
    opened_s = time.perf_counter() - started
    samples = []
    for _ in range(3):
        samples.append(stack.gateway.rss_mb())
        await asyncio.sleep(0.1)  # spaced RSS samples while the streams are held
    await loadgen.release(protocols)
    return {
        "streams": plan.hold_streams,
        "open": window.first_outputs,
        "open_s": opened_s,
        "rss_mb": max(samples),
        "errors": window.errors,
    }


def run_hold(stack: Stack, plan: Plan, report: Report) -> None:
    held = run_loop(_hold(stack, plan))
    released = _wait_released(stack)
    held["rss_after_release_mb"] = stack.gateway.rss_mb()
    held["released"] = released
    report.phases["hold"] = {"gateway": held}
    label = f"(e) {plan.hold_streams} slow streams held"
    rss, opened = held["rss_mb"], held["open"]
    all_open = opened == plan.hold_streams
    change = f"all open in {held['open_s']:.1f} s" if all_open else f"ONLY {opened} open"
    met = rss < 300 and all_open
    report.rows.append(Row(label, "RSS MB while held", None, rss, change, "< 300 MB", met))
    if not all_open:
        report.notes.append(
            f"only {opened} of {plan.hold_streams} streams had content "
            f"{HOLD_OPEN_TIMEOUT_S:g} s after they were opened"
        )
    after = held["rss_after_release_mb"]
    report.rows.append(Row(label, "RSS MB after release", None, after, "", "", None))
    if not released:
        report.notes.append("gateway still had requests in flight 10 s after clients left")


def _wait_released(stack: Stack) -> bool:
    """Bounded poll: every upstream request closed once the clients went away."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = httpx.get(stack.gateway.url + "/admin/state", timeout=5).json()
        if all(b["in_flight"] == 0 for b in state["backends"]):
            return True
        time.sleep(0.05)
    return False


def gateway_config(backend_url: str, port: int) -> dict[str, Any]:
    return {
        "listen": {"host": HOST, "port": port},
        "backends": [{"name": "fast-0", "url": backend_url, "pool": "short", "models": [MODEL]}],
        # Above the held-streams scenario, so the pool is never a hidden limiter.
        "upstream": {"max_connections": 4096},
        # The relay is measured, not admission: a fixed limit no scenario reaches.
        "admission": {"limit": {"kind": "static", "initial": 4096, "max": 4096}},
    }


def _presend(stack: Stack) -> tuple[float, float] | None:
    """The gateway's own time from reading a request to writing it upstream, over its
    last requests (p50, p90 in ms): its pre-send share of the added TTFT, without the
    clients' and the kernel's part, so it moves far less from run to run."""
    url = stack.gateway.url + "/admin/requests?limit=256"
    records = httpx.get(url, timeout=5).json()["requests"]
    times = [r["upstream_s"] for r in records if r["upstream_s"] is not None]
    p50, p90 = ms(percentile(times, 50)), ms(percentile(times, 90))
    return None if p50 is None or p90 is None else (p50, p90)


def _measured_by_gateway(stack: Stack) -> dict[str, float]:
    """Proof that the gateway timed the streams it relayed: its own sample counts."""
    text = httpx.get(stack.gateway.url + "/metrics", timeout=5).text
    counts = {"ttft_samples": 0.0, "itl_samples": 0.0, "requests": 0.0}
    names = {
        "kneecap_request_ttft_seconds_count": "ttft_samples",
        "kneecap_request_itl_seconds_count": "itl_samples",
        "kneecap_requests_total": "requests",
    }
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            counts[names[name]] += float(line.rsplit(" ", 1)[1])
    return counts


def run(args: argparse.Namespace) -> Report:
    plan = Plan.quick(args.duration) if args.quick else Plan(args.duration, args.warmup)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    report = Report()
    if pin:
        os.sched_setaffinity(0, {args.load_core})
    else:
        report.notes.append("not pinned: gateway, backend and load share all cores")
    if args.realtime:
        procs.make_realtime()
        report.notes.append("realtime: gateway, backend and load ran SCHED_FIFO")
    scenarios = args.scenario or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="kneecap-perf-") as tmp:
        workdir = Path(tmp)
        backend_port, gateway_port = procs.free_port(), procs.free_port()
        backend = procs.start(
            "backend",
            ["gateway.perf.backend", "--port", str(backend_port)],
            f"http://{HOST}:{backend_port}",
            "/health",
            workdir / "backend.log",
            args.load_core if pin else None,
            args.realtime,
        )
        gateway = floor = None
        routers: dict[str, procs.Proc] = {}
        try:
            floor_port = procs.free_port()
            relay_args = ["--port", str(floor_port), "--upstream-port", str(backend_port)]
            floor = procs.start(
                "tcp-relay",
                ["gateway.perf.tcp_relay", *relay_args],
                f"http://{HOST}:{floor_port}",
                "/health",
                workdir / "tcp-relay.log",
                args.gateway_core if pin else None,
                args.realtime,
            )
            config = workdir / "gateway.yaml"
            config.write_text(yaml.safe_dump(gateway_config(backend.url, gateway_port)))
            gateway = procs.start(
                "gateway",
                ["gateway.cli", "serve", "--config", str(config), "--log-level", "warning"],
                f"http://{HOST}:{gateway_port}",
                "/ready",
                workdir / "gateway.log",
                args.gateway_core if pin else None,
                args.realtime,
            )
            idle_at_start = gateway.rss_mb()
            for spec in args.router or ():
                core = args.gateway_core if pin else None
                routers[spec.name] = start_router(spec, backend.url, workdir, core, args.realtime)
            routers_idle = {name: proc.rss_mb() for name, proc in routers.items()}
            stack = Stack(backend, gateway, floor, routers)
            for name in scenarios:
                if name == "nonstream":
                    run_nonstream(stack, plan, report)
                elif name == "stream":
                    run_stream(stack, plan, report)
                elif name == "paced":
                    run_paced(stack, plan, report)
                elif name == "idle":
                    run_idle(stack, plan, report, idle_at_start, routers_idle)
                elif name == "hold":
                    run_hold(stack, plan, report)
            report.phases["measured_by_gateway"] = _measured_by_gateway(stack)
            report.phases["setup"] = {
                "pinned": pin,
                "realtime": args.realtime,
                "gateway_core": args.gateway_core if pin else None,
                "load_core": args.load_core if pin else None,
                "gateway_pid": gateway.pid,
                "python": sys.version.split()[0],
            }
        finally:
            for proc in (gateway, floor, *routers.values()):
                if proc is not None:
                    proc.stop()
            backend.stop()
    return report


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def render(report: Report) -> str:
    header = ("scenario", "figure", "direct", "via gateway", "change", "target", "met")
    lines = [header]
    for row in report.rows:
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        cells = (_fmt(row.direct), _fmt(row.gateway), row.change, row.target, met)
        lines.append((row.scenario, row.figure, *cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("")
    out.append("CPU % in each counted window (gateway alone on its core, backend + load on one):")
    for name, phase in report.phases.items():
        for target in phase if isinstance(phase, dict) else ():
            cpu = phase[target].get("cpu_percent") if isinstance(phase[target], dict) else None
            if cpu:
                shares = "  ".join(f"{k} {v:5.1f}" for k, v in cpu.items())
                causes = phase[target]["error_causes"]
                errors = ", ".join(f"{n}x {c}" for c, n in causes.items()) or "0"
                out.append(f"  {name:<9} {target:<7}  {shares}  errors {errors}")
    measured = report.phases.get("measured_by_gateway")
    if measured:
        out.append(
            "Gateway's own measurement (on throughout): "
            + ", ".join(f"{k} {v:,.0f}" for k, v in measured.items())
        )
    out += [f"note: {note}" for note in report.notes]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.perf.relay_bench",
        description="What the gateway adds: direct vs through-gateway, gateway on one core.",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="run only these (repeatable); default: all, in order",
    )
    parser.add_argument("--duration", type=float, default=5.0, help="counted seconds per phase")
    parser.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds per phase")
    parser.add_argument("--gateway-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1, help="backend and load generator")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset/affinity")
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run gateway, backend and load SCHED_FIFO (root): on a shared machine, other "
        "processes then cannot delay them, as if each had its core to itself",
    )
    parser.add_argument(
        "--router",
        action="append",
        type=parse_router,
        metavar="NAME=COMMAND",
        help="also run the load through another router, started by COMMAND with {port}, "
        "{backend} and {metrics_port} filled in, pinned as the gateway is (repeatable; "
        "not with the hold scenario's 2,000 streams)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny loads: a smoke test only")
    parser.add_argument("--json", type=Path, help="also write every figure as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(render(report), flush=True)
    if args.json:
        rows = [row.__dict__ for row in report.rows]
        args.json.write_text(json.dumps({"rows": rows, "phases": report.phases}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
