"""Issue 7's routing claim, shorter, through the real HTTP path.

    python -m backends.sim.system.routing_http_check [--speed 4] [--duration 45]

Starts three simulated ``qwen3-4b/l40s/bf16/vllm`` replicas (``kneecap sim
--speed K``, seeds 0-2) and two gateways in front of them:

* **kneecap**: pools ``short: < 8192`` (replicas 0, 1) and ``long: >= 8192``
  (replica 2), headroom router, a static limit of 32 per backend, the token
  budget at 0.95 x the profile's KV tokens (``max_tokens_in_flight``: the sim
  does not export its KV capacity);
* **round-robin**: one pool holding all three, ``routing.policy: round_robin``,
  a static limit of 100,000 (no limit), no token budget.

Every time constant the gateway's queue enforces (``max_queue_wait_s``) is
divided by K. The same seeded open-loop Poisson workload as
:mod:`backends.sim.system.routing_acceptance` -- 85 % chat (1,024-token
prompts), 15 % RAG (16,384-32,768), 256 output tokens (ignore_eos), at 90 % of
the measured capacity (3.11 req/s) -- is driven against each gateway in turn,
arrival times divided by K, for ``--duration`` wall seconds, then drained for a
bounded time. TTFT is the client's: from sending to the first SSE event
carrying content (the gateway's queue wait included). Every figure is printed
in engine time (wall x K) next to the virtual-time figures of
docs/routing-acceptance.md. Processes are stopped by PID whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from backends.sim.profiles import get_profile
from backends.sim.system.report import fmt, pct
from backends.sim.system.routing_acceptance import (
    CHAT_SHARE,
    LOAD_SHARE,
    OUTPUT,
    PROFILE,
    REQUEST_LIMIT,
    SEED,
    SHORT_P95_RATIO,
    THROUGHPUT_BAND,
    draw_prompt,
)
from backends.sim.system.routing_seams import KV_FRACTION, LONG_FROM
from backends.sim.tokenizer import CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_REPLY, text_of_tokens
from gateway.perf.procs import Proc, free_port
from gateway.perf.procs import start_kneecap as start

MODEL = "Qwen/Qwen3-4B"
CAPACITY = 3.11  # req/s, the virtual-time sweep's median (docs/routing-acceptance.md)
QUEUE_WAIT_S = 30.0  # the pools' default queue deadline, engine seconds
WARMUP_S = 60.0  # engine seconds of arrivals not measured (as in virtual time), at most 1/3
ROOT = Path(__file__).resolve().parents[3]

# docs/routing-acceptance.md, (a): 600 s of arrivals at 2.80 req/s, seed 7.
VIRTUAL = {
    "kneecap": {"short_p50": 0.06, "short_p95": 0.069, "long_p95": 32.83, "tok_s": 689,
                "short_shed": 0, "long_shed": 66, "long_n": 215},
    "round-robin": {"short_p50": 0.07, "short_p95": 2.206, "long_p95": 4.16, "tok_s": 715,
                    "short_shed": 0, "long_shed": 0, "long_n": 215},
}  # fmt: skip


def _common(port: int, speed: float) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "upstream": {"read_timeout_s": 120, "max_connections": 100_000},
    }


def kneecap_config(sims: list[str], speed: float, port: int) -> dict:
    budget = int(KV_FRACTION * get_profile(PROFILE).kv_tokens)
    limit = {"kind": "static", "initial": REQUEST_LIMIT, "min": 1, "max": REQUEST_LIMIT}
    pools = ["short", "short", "long"]
    return {
        **_common(port, speed),
        "pools": {
            "short": {"max_prompt_tokens": LONG_FROM, "max_queue_wait_s": QUEUE_WAIT_S / speed},
            "long": {"min_prompt_tokens": LONG_FROM, "max_queue_wait_s": QUEUE_WAIT_S / speed},
        },
        "backends": [
            {
                "name": f"sim-{i}",
                "url": url,
                "pool": pool,
                "models": [MODEL],
                "limit": limit,
                "max_tokens_in_flight": budget,
            }
            for i, (url, pool) in enumerate(zip(sims, pools, strict=True))
        ],
        "routing": {"policy": "headroom"},
    }


def round_robin_config(sims: list[str], speed: float, port: int) -> dict:
    limit = {"kind": "static", "initial": 100_000, "min": 1, "max": 100_000}
    return {
        **_common(port, speed),
        "pools": {"short": {"max_queue_wait_s": QUEUE_WAIT_S / speed}},
        "backends": [
            {"name": f"sim-{i}", "url": url, "pool": "short", "models": [MODEL], "limit": limit}
            for i, url in enumerate(sims)
        ],
        "routing": {"policy": "round_robin", "token_budget": {"enabled": False}},
    }


# -- the workload ----------------------------------------------------------------------


def workload(rate: float, traffic_s: float) -> list[tuple[float, int]]:
    """(arrival, prompt tokens) in engine seconds: the virtual-time run's seeded draw."""
    rng = random.Random(SEED)
    out, t = [], rng.expovariate(rate)
    while t < traffic_s:
        out.append((t, draw_prompt(rng)))
        t += rng.expovariate(rate)
    return out


@dataclass
class Result:
    arrived: float  # engine s
    prompt: int
    status: int | None = None  # None: transport error / unfinished
    ttft: float | None = None  # engine s, from sending to the first content event
    output_tokens: int = 0  # from usage
    error: str | None = None


@dataclass
class Measured:
    results: list[Result] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # engine s of each content event
    statuses: Counter[int] = field(default_factory=Counter)
    client_lag: float = 0.0
    wall: float = 0.0
    unfinished: int = 0


async def one(
    http: httpx.AsyncClient, url: str, res: Result, body: dict, m: Measured, t0: float, k: float
) -> None:
    sent = time.monotonic()
    try:
        async with http.stream("POST", url, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = await r.aread()
                res.error = text[:200].decode(errors="replace")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"content":"' in line and '"content":""' not in line:
                    now = time.monotonic()
                    if res.ttft is None:
                        res.ttft = (now - sent) * k
                    m.token_times.append((now - t0) * k)
                elif '"usage":{' in line:
                    tail = line.split('"completion_tokens":', 1)
                    if len(tail) == 2:
                        res.output_tokens = int(tail[1].split(",", 1)[0].split("}", 1)[0])
    except httpx.HTTPError as exc:
        res.status = None
        res.error = type(exc).__name__


async def heartbeat(m: Measured, stop: asyncio.Event) -> None:
    while not stop.is_set():
        before = time.monotonic()
        await asyncio.sleep(0.01)
        m.client_lag = max(m.client_lag, time.monotonic() - before - 0.01)


async def drive(gateway: str, plan: list[tuple[float, int]], k: float, drain_s: float) -> Measured:
    m = Measured()
    texts: dict[int, str] = {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeout = httpx.Timeout(120.0, connect=10.0)
    url = gateway + "/v1/chat/completions"
    stop = asyncio.Event()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        beat = asyncio.create_task(heartbeat(m, stop))
        tasks = []
        t0 = time.monotonic()
        for arrival, prompt in plan:
            content = texts.get(prompt)
            if content is None:
                n = prompt - CHAT_TOKENS_PER_MESSAGE - CHAT_TOKENS_PER_REPLY
                content = texts[prompt] = text_of_tokens(n)
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": OUTPUT,
                "ignore_eos": True,
            }
            delay = t0 + arrival / k - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            res = Result(arrived=(time.monotonic() - t0) * k, prompt=prompt)
            m.results.append(res)
            tasks.append(asyncio.create_task(one(http, url, res, body, m, t0, k)))
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        m.unfinished = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        m.wall = time.monotonic() - t0
        stop.set()
        await beat
    for res in m.results:
        m.statuses[res.status if res.status is not None else 0] += 1
    return m


# -- the report ----------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    short_n: int
    long_n: int
    short_p50: float | None
    short_p95: float | None
    long_p95: float | None
    tok_s: float
    short_shed: int
    long_shed: int
    errors: int  # transport errors and non-429 failures
    unfinished: int


def figures(m: Measured, warmup: float, traffic_s: float) -> Figures:
    measured = [r for r in m.results if warmup <= r.arrived < traffic_s]
    short = [r for r in measured if r.prompt < LONG_FROM]
    long = [r for r in measured if r.prompt >= LONG_FROM]

    def ttfts(rs: list[Result]) -> list[float]:
        return [r.ttft for r in rs if r.status == 200 and r.ttft is not None]

    tokens = sum(1 for t in m.token_times if warmup < t <= traffic_s)
    return Figures(
        short_n=len(short),
        long_n=len(long),
        short_p50=pct(ttfts(short), 50),
        short_p95=pct(ttfts(short), 95),
        long_p95=pct(ttfts(long), 95),
        tok_s=tokens / (traffic_s - warmup),
        short_shed=sum(1 for r in short if r.status == 429),
        long_shed=sum(1 for r in long if r.status == 429),
        errors=sum(1 for r in measured if r.status not in (200, 429)),
        unfinished=m.unfinished,
    )


Runs = dict[str, tuple[Measured, Figures]]


def report(args: argparse.Namespace, rate: float, runs: Runs) -> None:
    k = args.speed
    traffic = args.duration * k
    print(
        f"# Routing through the HTTP path: 3 x {PROFILE} sims at speed {k:g}x\n\n"
        f"Open-loop Poisson at {rate:.2f} req/s engine time ({LOAD_SHARE:.0%} of {CAPACITY} req/s; "
        f"{rate * k:.2f} req/s wall), {CHAT_SHARE:.0%} chat (1,024) / RAG (16K-32K), "
        f"{OUTPUT} output tokens, seed {SEED}; arrivals for {traffic:.0f} engine s "
        f"({args.duration:g} s wall), measured on arrivals {min(WARMUP_S, traffic / 3):.0f}-"
        f"{traffic:.0f} s. All figures in engine seconds (wall x {k:g}).\n"
    )
    print(
        "| setup | path | short n | short p50 TTFT | short p95 TTFT | long n | long p95 TTFT "
        "| output tok/s | shed short | shed long | errors | unfinished |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (_, f) in runs.items():
        print(
            f"| {name} | HTTP | {f.short_n} | {fmt(f.short_p50, ' s', 3)} "
            f"| {fmt(f.short_p95, ' s', 3)} | {f.long_n} | {fmt(f.long_p95, ' s')} "
            f"| {f.tok_s:,.0f} | {f.short_shed} | {f.long_shed} | {f.errors} | {f.unfinished} |"
        )
        v = VIRTUAL[name]
        print(
            f"| {name} | virtual (600 s) | 1311 | {v['short_p50']:.2f} s | {v['short_p95']:.3f} s "
            f"| {v['long_n']} | {v['long_p95']:.2f} s | {v['tok_s']} | {v['short_shed']} "
            f"| {v['long_shed']} | 0 | 0 |"
        )
    kn, rr = runs["kneecap"][1], runs["round-robin"][1]
    ratio = rr.short_p95 / kn.short_p95 if kn.short_p95 and rr.short_p95 else None
    through = kn.tok_s / rr.tok_s if rr.tok_s else None
    v_ratio, v_through = 31.9, 0.963  # as docs/routing-acceptance.md prints them
    ok_ratio = ratio is not None and ratio >= SHORT_P95_RATIO
    ok_through = through is not None and abs(through - 1) <= THROUGHPUT_BAND
    print(
        f"\n- short p95 TTFT, round-robin / kneecap: HTTP {fmt(ratio, 'x', 1)} "
        f"(target >= {SHORT_P95_RATIO:.0f}x: {'PASS' if ok_ratio else 'MISS'}); "
        f"virtual {v_ratio:.1f}x"
    )
    print(
        f"- output tok/s, kneecap / round-robin: HTTP {fmt(through, '', 3)} "
        f"(target within {THROUGHPUT_BAND:.0%}: {'PASS' if ok_through else 'MISS'}); "
        f"virtual {v_through:.3f}"
    )
    for name, (m, _) in runs.items():
        statuses = ", ".join(f"{s or 'error'}: {n}" for s, n in sorted(m.statuses.items()))
        print(
            f"- {name}: {len(m.results)} requests sent ({statuses}); {m.wall:.0f} s wall; "
            f"client event loop stalled up to {m.client_lag * 1000:,.0f} ms; "
            f"{len(m.token_times):,} content events vs "
            f"{sum(r.output_tokens for r in m.results):,} output tokens in usage"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=45.0, help="wall s of arrivals")
    parser.add_argument("--drain", type=float, default=15.0, help="wall s, at most, after")
    args = parser.parse_args(argv)
    k = args.speed
    rate = LOAD_SHARE * CAPACITY
    traffic = args.duration * k
    plan = workload(rate, traffic)
    warmup = min(WARMUP_S, traffic / 3)
    runs: Runs = {}
    with tempfile.TemporaryDirectory(prefix="kneecap-routing-http-") as tmp:
        tmpdir = Path(tmp)
        procs: list[Proc] = []
        try:
            sims = []
            for i in range(3):
                port = free_port()
                sim_args = ["sim", "--port", str(port), "--model", MODEL, "--profile", PROFILE]
                sim_args += ["--speed", str(k), "--seed", str(i)]
                sims.append(start(sim_args, port, tmpdir / f"sim-{i}.log", procs).url)
            for name, build in (("kneecap", kneecap_config), ("round-robin", round_robin_config)):
                port = free_port()
                config = tmpdir / f"{name}.yaml"
                config.write_text(yaml.safe_dump(build(sims, k, port)))
                gw_args = ["serve", "--config", str(config), "--log-level", "warning"]
                gateway = start(gw_args, port, tmpdir / f"{name}.log", procs)
                measured = asyncio.run(drive(gateway.url, plan, k, args.drain))
                runs[name] = (measured, figures(measured, warmup, traffic))
                gateway.stop()  # one gateway at a time in front of the sims
                print(f"({name}: done, {measured.wall:.0f} s wall)", file=sys.stderr)
        finally:
            for proc in reversed(procs):
                proc.stop()
    report(args, rate, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
