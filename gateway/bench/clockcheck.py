"""``python -m gateway.bench.clockcheck``: do the simulator's two clocks agree?

Runs one sweep twice: on the virtual clock (``kneecap bench --sim``, no
sockets, seconds) and over HTTP against a ``kneecap sim --speed K`` process
that it starts on 127.0.0.1 and stops by PID (``kneecap bench --url …
--speed K``, figures read on the simulator's time). Per load point it prints
each figure from both runs, the ratio HTTP ÷ virtual and whether that is within
the tolerance (25 %), and what else the machine ran meanwhile: on a shared
machine another process that takes the simulator's core for a millisecond
costs K milliseconds of simulated time, so a failing figure next to a busy
machine says little about the clocks.

By default the simulator is pinned to one core and this process (the load
generator) to another; ``--realtime`` also runs both SCHED_FIFO (root), so
ordinary processes cannot delay them. Exit status: 0 when every figure agrees,
1 when one does not, 2 when the check could not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from gateway.bench import compare
from gateway.bench.client import TargetError
from gateway.bench.command import HAS_UVLOOP
from gateway.bench.loadgen import HttpTarget
from gateway.bench.phase import LoadPoint
from gateway.bench.progress import ProgressDisplay, prompts_of
from gateway.bench.prompts import ENDPOINTS
from gateway.bench.simtarget import SimTarget
from gateway.bench.slo import parse_slo
from gateway.bench.stats import PointSummary
from gateway.bench.sweep import DEFAULT_STAGGER_S, SweepPlan, SweepResult, run_sweep
from gateway.bench.target import Target
from gateway.bench.workload import Workload, parse_prompt_tokens, workloads_from
from gateway.perf import procs

HOST = "127.0.0.1"
# The sweep (its acceptance: every figure within 25 % at --speed 20).
DEFAULT_PROFILE = "qwen3-4b/l40s/bf16/vllm"
DEFAULT_CONCURRENCY = "1,8,16,32,48,64,96"
DEFAULT_SLO = "ttft_p95_ms=500"
DEFAULT_OUTPUT_TOKENS = 2816

FIGURES: dict[str, compare.Figure] = {
    **compare.FIGURES,
    "e2e_p95_ms": lambda p: p.e2e.at(95.0) * 1e3 if p.e2e else None,
}
LABELS = {
    "output_tok_s": "out tok/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p95_ms": "TTFT p95 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p95_ms": "ITL p95 ms",
    "e2e_p50_ms": "E2E p50 ms",
    "e2e_p95_ms": "E2E p95 ms",
}


@dataclass(frozen=True, slots=True)
class FigureCheck:
    figure: str
    virtual: float | None
    http: float | None
    ratio: float | None  # http / virtual
    ok: bool


@dataclass(frozen=True, slots=True)
class CpuShare:
    """Cores in use during one HTTP point (CPU seconds / wall seconds)."""

    sim: float
    bench: float
    others: float  # every other process on the machine


@dataclass(frozen=True, slots=True)
class PointCheck:
    load: float
    figures: tuple[FigureCheck, ...]
    cpu: CpuShare | None = None

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.figures)


def check_figure(
    name: str, virtual: float | None, http: float | None, tolerance: float
) -> FigureCheck:
    """One figure: it agrees when HTTP is within ``tolerance`` of virtual, either way."""
    if virtual is None or http is None or virtual <= 0:
        return FigureCheck(name, virtual, http, None, virtual is None and http is None)
    ratio = http / virtual
    return FigureCheck(name, virtual, http, ratio, abs(ratio - 1.0) <= tolerance)


def check_points(
    virtual: Sequence[PointSummary],
    http: Sequence[PointSummary],
    tolerance: float,
    cpu: Sequence[CpuShare | None] = (),
) -> list[PointCheck]:
    """Every figure of every load point, virtual against HTTP (same loads, same order)."""
    if [p.load for p in virtual] != [p.load for p in http]:
        raise ValueError("the two runs measured different loads")
    shares = list(cpu) + [None] * (len(virtual) - len(cpu))
    return [
        PointCheck(
            v.load,
            tuple(check_figure(n, f(v), f(h), tolerance) for n, f in FIGURES.items()),
            share,
        )
        for v, h, share in zip(virtual, http, shares, strict=True)
    ]


def render(rows: Sequence[PointCheck], tolerance: float) -> str:
    lines = [f"{'load':>5}  {'figure':<12} {'virtual':>10} {'http':>10} {'ratio':>6}"]
    for row in rows:
        for i, f in enumerate(row.figures):
            load = f"{row.load:g}" if i == 0 else ""
            ratio = "-" if f.ratio is None else f"{f.ratio:.2f}"
            verdict = "ok" if f.ok else "FAIL"
            lines.append(
                f"{load:>5}  {LABELS.get(f.figure, f.figure):<12} {_num(f.virtual):>10} "
                f"{_num(f.http):>10} {ratio:>6}  {verdict}"
            )
        if row.cpu is not None:
            lines.append(
                f"{'':>5}  cores in use: sim {row.cpu.sim:.2f}, load generator "
                f"{row.cpu.bench:.2f}, other processes {row.cpu.others:.2f}"
            )
    checks = [f for row in rows for f in row.figures]
    agree = sum(f.ok for f in checks)
    verdict = "the clocks agree" if agree == len(checks) else "the clocks DISAGREE"
    lines.append(
        f"{agree} of {len(checks)} figures within {tolerance:.0%} of the virtual clock: {verdict}"
    )
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


class _CpuMeter(ProgressDisplay):
    """The progress display, also sampling who used the CPU during each point."""

    def __init__(self, stream: Any, sim_pid: int) -> None:
        super().__init__(stream)
        self._sim_pid = sim_pid
        self._start: tuple[float, float, float, float] | None = None
        self.shares: list[CpuShare | None] = []

    def _sample(self) -> tuple[float, float, float, float] | None:
        try:
            busy = sum(procs.core_busy_seconds().values())
            return time.monotonic(), busy, procs.cpu_seconds(self._sim_pid), procs.cpu_seconds()
        except (OSError, ValueError, RuntimeError):  # no /proc: not Linux
            return None

    def begin(self, number: int, total: int, target: str, workload: str, point: LoadPoint) -> None:
        self._start = self._sample()
        super().begin(number, total, target, workload, point)

    def end(self, summary: PointSummary) -> None:
        end = self._sample()
        share = None
        if self._start is not None and end is not None and end[0] > self._start[0]:
            wall, busy, sim, bench = (b - a for a, b in zip(self._start, end, strict=True))
            share = CpuShare(sim / wall, bench / wall, max(0.0, busy - sim - bench) / wall)
        self.shares.append(share)
        super().end(summary)


def _plan(args: argparse.Namespace) -> tuple[SweepPlan, list[Workload]]:
    loads = tuple(sorted({float(x) for x in args.concurrency.split(",") if x.strip()}))
    plan = SweepPlan(
        kind="concurrency",
        loads=loads,
        requests=args.requests,
        seed=args.seed,
        slo=parse_slo(args.slo) if args.slo else None,
        stagger=args.stagger,
    )
    mixes = parse_prompt_tokens(args.prompt_tokens)
    return plan, workloads_from(mixes[:1], args.output_tokens, args.seed)


async def _sweep(
    plan: SweepPlan,
    workloads: list[Workload],
    target: Target,
    progress: ProgressDisplay,
    limit_s: float = math.inf,
) -> SweepResult:
    try:
        with anyio.fail_after(limit_s):
            return await run_sweep(plan, workloads, [target], progress)
    finally:
        await target.aclose()


def _estimate_s(virtual: SweepResult, speed: float) -> float:
    """Wall seconds of the HTTP sweep: each point's window plus about one request of warm-up."""
    points = [p for s in virtual.series for p in s.points]
    return sum(p.duration_s + (p.e2e.mean if p.e2e else 0.0) for p in points) / speed


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan, workloads = _plan(args)
    err = None if args.quiet else sys.stderr
    run_opts = {"backend_options": {"use_uvloop": HAS_UVLOOP}}
    virtual = anyio.run(
        _sweep, plan, workloads, SimTarget.for_profile(args.profile), ProgressDisplay(None)
    )
    estimate = _estimate_s(virtual, args.speed)
    limit = 2 * estimate + 120
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    where = f"sim on core {args.sim_core}, load on core {args.load_core}" if pin else "not pinned"
    fifo = ", both SCHED_FIFO" if args.realtime else ""
    print(
        f"clock check: {args.profile}, {prompts_of(workloads[0].label)}, "
        f"{args.output_tokens} output tokens, concurrency {args.concurrency}\n"
        f"HTTP at --speed {args.speed:g}: about {estimate:.0f} s (stopped after {limit:.0f} s); "
        f"{where}{fifo}; load average {_loadavg()}",
        flush=True,
    )
    if pin:
        os.sched_setaffinity(0, {args.load_core})
    if args.realtime:
        procs.make_realtime()
    gc.freeze()  # what exists now lives to the end: keep the collector's full passes short
    port = procs.free_port()
    url = f"http://{HOST}:{port}"
    with tempfile.TemporaryDirectory(prefix="kneecap-clockcheck-") as tmp:
        sim_args = ["gateway.cli", "sim", "--host", HOST, "--port", str(port)]
        sim_args += ["--profile", args.profile, "--speed", f"{args.speed:g}"]
        log = Path(tmp) / "sim.log"
        sim = procs.start(
            "sim", sim_args, url, "/health", log, args.sim_core if pin else None, args.realtime
        )
        try:
            target = HttpTarget(
                url,
                endpoint=ENDPOINTS["chat"],
                max_in_flight=int(max(plan.loads)),
                speed=args.speed,
            )
            meter = _CpuMeter(err, sim.pid)
            try:
                http = anyio.run(_sweep, plan, workloads, target, meter, limit, **run_opts)
            except TimeoutError:
                raise TargetError(f"the HTTP sweep did not finish within {limit:.0f} s") from None
        finally:
            sim.stop()
    rows = check_points(
        virtual.series[0].points, http.series[0].points, args.tolerance, meter.shares
    )
    print(render(rows, args.tolerance), end="")
    knees = (virtual.series[0].knee.load, http.series[0].knee.load)
    print(f"knee: virtual {_num(knees[0])}, HTTP {_num(knees[1])}; load average {_loadavg()}")
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "ok": all(r.ok for r in rows),
        "knee": {"virtual": knees[0], "http": knees[1]},
        "points": [
            {
                "load": r.load,
                "cores": None if r.cpu is None else dataclasses.asdict(r.cpu),
                "figures": {f.figure: dataclasses.asdict(f) for f in r.figures},
            }
            for r in rows
        ],
    }


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.bench.clockcheck",
        description="The same sweep on the virtual clock and over HTTP against kneecap sim "
        "--speed K: every figure side by side, with ratios and pass/fail.",
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--speed", type=float, default=20.0, help="the simulator's speed-up")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, metavar="LIST")
    parser.add_argument("--requests", type=int, help="counted requests per point (default: auto)")
    parser.add_argument("--prompt-tokens", default="1024", metavar="N")
    parser.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS)
    parser.add_argument("--slo", default=DEFAULT_SLO, help="for the knees (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stagger",
        type=float,
        default=DEFAULT_STAGGER_S,
        metavar="S",
        help="seconds between the clients' first requests (default %(default)s)",
    )
    parser.add_argument("--tolerance", type=float, default=0.25, help="default %(default)s")
    parser.add_argument("--sim-core", type=int, default=0)
    parser.add_argument("--load-core", type=int, default=1, help="this process: the load")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset/affinity")
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run the simulator and the load generator SCHED_FIFO (root): on a shared "
        "machine, ordinary processes then cannot delay them",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the checks here")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        document = run(args)
    except (TargetError, ValueError, RuntimeError, TimeoutError, PermissionError) as exc:
        print(f"clockcheck: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
