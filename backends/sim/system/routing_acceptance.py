"""Issue 7's acceptance on the whole-system simulation: every number, one command.

    python -m backends.sim.system.routing_acceptance [--quick]

Three ``qwen3-4b/l40s/bf16/vllm`` replicas; mixed traffic (fixed seed): 85 % chat
(1,024-token prompts), 15 % RAG (16,384-32,768-token prompts, uniform), 256
output tokens each (ignore_eos). TTFT is the client's: from arrival, the
gateway's queue wait included. Queues: the gateway's defaults (256 waiters,
30 s deadline).

0. capacity: closed-loop clients sending the mix to the three replicas
   (round-robin, no admission limits), at client counts that saturate them;
   the median completion rate of the sweep is their combined capacity (one
   run's rate swings by +-5 % with the RAG requests' share of its window). The
   open-loop Poisson rate is :data:`LOAD_SHARE` of it.
(a) kneecap -- pools ``short: < 8192`` (2 replicas) and ``long: >= 8192``
    (1 replica), headroom router, a static request limit of
    :data:`REQUEST_LIMIT` on every backend, token budget 0.95 x KV capacity --
    vs round-robin over the same three replicas, no admission limits. For
    information, kneecap with 1 short + 2 long replicas.
(c) the long pool: token-budget vs count-only admission (the same request
    limit, no token budget; and count-only with the long pool's request limit
    cut to the KV cache's worth of average RAG prompts), same traffic;
    preemptions as the simulated engine counts them.
(full only) the headline comparison at 80 % and 100 % of capacity.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.sim.profiles import get_profile
from backends.sim.system.model import SHED, SimRequest
from backends.sim.system.report import fmt, pct
from backends.sim.system.routing_seams import KV_FRACTION, LONG_FROM, kneecap, round_robin
from backends.sim.system.sim import SystemSim
from policies.token_budget import token_budget

PROFILE = "qwen3-4b/l40s/bf16/vllm"
CHAT_SHARE = 0.85
CHAT_PROMPT = 1024
RAG_PROMPT = (16_384, 32_768)  # uniform, both ends included
OUTPUT = 256
REQUEST_LIMIT = 32  # static, every backend: the static controller's default
LONG_COUNT_LIMIT = 8  # KV tokens / (mean RAG prompt + output), rounded down
LOAD_SHARE = 0.9  # the open-loop rate, as a share of the measured capacity
SENSITIVITY = (0.8, 1.0)
SEED = 7

SHORT_P95_RATIO = 5.0  # the targets (issue 7)
THROUGHPUT_BAND = 0.10


@dataclass(frozen=True, slots=True)
class Plan:
    capacity_clients: tuple[int, ...]  # closed-loop client counts swept for capacity
    capacity_s: float  # each; measured over the second half
    traffic_s: float  # open-loop arrivals in [0, traffic_s)
    warmup_s: float  # measured: arrivals in [warmup_s, traffic_s), tokens in that span
    drain_s: float  # after the last arrival, for the admitted requests to finish
    sensitivity: bool


FULL = Plan((96, 192, 384), 2400.0, 600.0, 60.0, 300.0, True)
QUICK = Plan((96, 192, 384), 1200.0, 300.0, 60.0, 240.0, False)


# -- traffic ----------------------------------------------------------------------


def draw_prompt(rng: random.Random) -> int:
    """One request's prompt tokens: chat with CHAT_SHARE, else RAG."""
    if rng.random() < CHAT_SHARE:
        return CHAT_PROMPT
    return rng.randint(*RAG_PROMPT)


def is_long(request: SimRequest) -> bool:
    return request.prompt_tokens >= LONG_FROM


class MixedPoisson:
    """Open loop: arrivals at ``rate`` per second until ``stop``, each drawn from the mix."""

    def __init__(self, sim: SystemSim, rate: float, *, stop: float, seed: int) -> None:
        self._sim = sim
        self._rate = rate
        self._stop = stop
        self._rng = random.Random(seed)
        sim.at(self._rng.expovariate(rate), self._arrive)

    def _arrive(self) -> None:
        sim = self._sim
        if sim.now >= self._stop:
            return
        sim.submit(draw_prompt(self._rng), OUTPUT)
        sim.at(sim.now + self._rng.expovariate(self._rate), self._arrive)


class MixedClosedLoop:
    """Closed loop: each client sends its next request (drawn from the mix) when answered."""

    def __init__(self, sim: SystemSim, clients: int, *, seed: int) -> None:
        self._sim = sim
        self._rng = random.Random(seed)
        for _ in range(clients):
            sim.at(self._rng.uniform(0.0, 2.0), self._send)

    def _send(self, answered: SimRequest | None = None) -> None:
        del answered
        self._sim.submit(draw_prompt(self._rng), OUTPUT, on_done=self._send)


# -- measuring ----------------------------------------------------------------------


def preemptions(sim: SystemSim, pool: str | None = None) -> int:
    return sum(b.engine.stats().preemptions_total for b in sim.backends if pool in (None, b.pool))


@dataclass(frozen=True, slots=True)
class Capacity:
    clients: int
    req_per_s: float
    tokens_per_s: float
    preemptions: int


def capacity(plan: Plan) -> list[Capacity]:
    """Closed-loop saturation of the three replicas, measured over each run's second half."""
    rows = []
    for clients in plan.capacity_clients:
        sim = round_robin(PROFILE, seed=SEED)
        MixedClosedLoop(sim, clients, seed=SEED)
        sim.run(plan.capacity_s)
        t0 = plan.capacity_s / 2
        done = sum(1 for r in sim.requests if r.status == "ok" and (r.finished or 0.0) > t0)
        tokens = sum(i.tokens for i in sim.intervals if i.t > t0)
        span = plan.capacity_s - t0
        rows.append(Capacity(clients, done / span, tokens / span, preemptions(sim)))
    return rows


@dataclass(frozen=True, slots=True)
class ClassFigures:
    """One class of requests (short or long) arriving in the measured span."""

    arrived: int
    ttft_p50: float | None  # from arrival, answered requests
    ttft_p95: float | None
    wait_p95: float | None  # in the gateway's queue, admitted requests
    queued: int  # admitted after a wait in the gateway's queue
    shed: int
    unfinished: int  # no answer by the end of the drain

    @property
    def shed_share(self) -> float:
        return self.shed / self.arrived if self.arrived else 0.0


def figures(requests: Sequence[SimRequest]) -> ClassFigures:
    ttfts = [r.first_token - r.arrived for r in requests if r.first_token is not None]
    waits = [w for r in requests if (w := r.queue_wait) is not None]
    return ClassFigures(
        arrived=len(requests),
        ttft_p50=pct(ttfts, 50),
        ttft_p95=pct(ttfts, 95),
        wait_p95=pct(waits, 95),
        queued=sum(1 for w in waits if w > 0),
        shed=sum(1 for r in requests if r.status in SHED),
        unfinished=sum(1 for r in requests if r.status is None),
    )


@dataclass(frozen=True, slots=True)
class Run:
    short: ClassFigures
    long: ClassFigures
    throughput: float  # output tokens/s streamed during the measured span
    prompt_throughput: float  # prompt tokens/s of the requests arriving in it and answered
    preemptions: int  # every engine, the whole run
    long_pool_preemptions: int  # the long pool's engines (none: 0)
    short_queue_max: int  # most requests waiting in the short pool at a tick


def open_loop(sim: SystemSim, rate: float, plan: Plan) -> Run:
    MixedPoisson(sim, rate, stop=plan.traffic_s, seed=SEED)
    sim.run(plan.traffic_s + plan.drain_s)
    t0, t1 = plan.warmup_s, plan.traffic_s
    measured = [r for r in sim.requests if t0 <= r.arrived < t1]
    spans = [i for i in sim.intervals if t0 < i.t <= t1]
    return Run(
        short=figures([r for r in measured if not is_long(r)]),
        long=figures([r for r in measured if is_long(r)]),
        throughput=sum(i.tokens for i in spans) / (len(spans) * sim.control_interval_s),
        prompt_throughput=sum(r.prompt_tokens for r in measured if r.status == "ok") / (t1 - t0),
        preemptions=preemptions(sim),
        long_pool_preemptions=preemptions(sim, "long"),
        short_queue_max=max((i.queued.get("short", 0) for i in sim.intervals), default=0),
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@dataclass(frozen=True, slots=True)
class Comparison:
    """kneecap against round-robin at one rate."""

    rate: float
    kneecap: Run
    round_robin: Run

    @property
    def short_p95_ratio(self) -> float | None:
        """How many times lower kneecap's short p95 TTFT is."""
        return ratio(self.round_robin.short.ttft_p95, self.kneecap.short.ttft_p95)

    @property
    def throughput_ratio(self) -> float | None:
        return ratio(self.kneecap.throughput, self.round_robin.throughput)

    @property
    def long_p95_ratio(self) -> float | None:
        """How many times higher kneecap's long p95 TTFT is."""
        return ratio(self.kneecap.long.ttft_p95, self.round_robin.long.ttft_p95)

    @property
    def short_ok(self) -> bool:
        r = self.short_p95_ratio
        return r is not None and r >= SHORT_P95_RATIO

    @property
    def throughput_ok(self) -> bool:
        r = self.throughput_ratio
        return r is not None and abs(r - 1) <= THROUGHPUT_BAND


def compare(rate: float, plan: Plan) -> Comparison:
    k = open_loop(kneecap(PROFILE, request_limit=REQUEST_LIMIT, seed=SEED), rate, plan)
    return Comparison(rate, k, open_loop(round_robin(PROFILE, seed=SEED), rate, plan))


@dataclass(frozen=True, slots=True)
class Acceptance:
    capacity: float  # req/s: the sweep's median
    headline: Comparison
    one_short_two_long: Run
    count_only: Run  # the same request limit, no token budget
    count_only_tight: Run  # the long pool's request limit at LONG_COUNT_LIMIT

    @property
    def preemptions_ok(self) -> bool:
        budgeted = self.headline.kneecap.long_pool_preemptions
        return budgeted == 0 and self.count_only.long_pool_preemptions > 0


def run_acceptance(plan: Plan) -> tuple[Acceptance, list[Capacity], list[Comparison]]:
    sweep = capacity(plan)
    cap = statistics.median(row.req_per_s for row in sweep)
    rate = LOAD_SHARE * cap
    split = kneecap(PROFILE, shorts=1, longs=2, request_limit=REQUEST_LIMIT, seed=SEED)
    count_only = kneecap(PROFILE, request_limit=REQUEST_LIMIT, budgeted=False, seed=SEED)
    tight = kneecap(
        PROFILE,
        request_limit=REQUEST_LIMIT,
        long_request_limit=LONG_COUNT_LIMIT,
        budgeted=False,
        seed=SEED,
    )
    result = Acceptance(
        capacity=cap,
        headline=compare(rate, plan),
        one_short_two_long=open_loop(split, rate, plan),
        count_only=open_loop(count_only, rate, plan),
        count_only_tight=open_loop(tight, rate, plan),
    )
    shares = SENSITIVITY if plan.sensitivity else ()
    return result, sweep, [compare(s * cap, plan) for s in shares]


# -- the report -----------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _row(setup: str, cls: str, c: ClassFigures) -> str:
    return (
        f"| {setup} | {cls} | {c.arrived} | {fmt(c.ttft_p50, ' s')} | {fmt(c.ttft_p95, ' s')} "
        f"| {fmt(c.wait_p95, ' s', 1)} | {c.queued} | {c.shed} ({c.shed_share:.0%}) "
        f"| {c.unfinished} |"
    )


def report(
    plan: Plan,
    result: Acceptance,
    sweep: Sequence[Capacity],
    sensitivity: Sequence[Comparison],
    out: Callable[[str], None],
) -> None:
    cap, head = result.capacity, result.headline
    k, rr = head.kneecap, head.round_robin
    out("## 0. Capacity: closed-loop mix on the three replicas (round-robin, no limits)\n")
    out("| clients | completed req/s | output tok/s | preemptions |")
    out("|---:|---:|---:|---:|")
    for row in sweep:
        out(
            f"| {row.clients} | {row.req_per_s:.2f} | {row.tokens_per_s:,.0f} | {row.preemptions} |"
        )
    tokens = statistics.median(row.tokens_per_s for row in sweep)
    out(
        f"\nCombined capacity (median): **{cap:.2f} req/s** ({tokens:,.0f} output tok/s). "
        f"Open-loop rate {LOAD_SHARE:.0%} of it: "
        f"**{head.rate:.2f} req/s** ({head.rate * CHAT_SHARE:.2f} chat + "
        f"{head.rate * (1 - CHAT_SHARE):.2f} RAG per s), arrivals for {plan.traffic_s:.0f} s, "
        f"measured {plan.warmup_s:.0f}-{plan.traffic_s:.0f} s, drained for "
        f"{plan.drain_s:.0f} s, seed {SEED}.\n"
    )
    out("## (a) kneecap (2 short + 1 long) vs round-robin (3 replicas)\n")
    out(
        "| setup | class | requests | p50 TTFT | p95 TTFT | p95 queue wait | queued | shed "
        "| unfinished |"
    )
    out("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, run in (
        ("kneecap 2+1", k),
        ("round-robin", rr),
        ("kneecap 1+2 (info)", result.one_short_two_long),
    ):
        out(_row(name, "short", run.short))
        out(_row(name, "long", run.long))
    split = result.one_short_two_long
    out(
        "\n| setup | output tok/s | vs round-robin | prompt tok/s answered | vs round-robin "
        "| preemptions |"
    )
    out("|---|---:|---:|---:|---:|---:|")
    for name, run in (("kneecap 2+1", k), ("round-robin", rr), ("kneecap 1+2 (info)", split)):
        output = ratio(run.throughput, rr.throughput)
        prompt = ratio(run.prompt_throughput, rr.prompt_throughput)
        out(
            f"| {name} | {run.throughput:,.0f} | {fmt(output, '', 3)} "
            f"| {run.prompt_throughput:,.0f} | {fmt(prompt, '', 3)} | {run.preemptions} |"
        )
    out(
        f"\n- short p95 TTFT {fmt(k.short.ttft_p95, ' s', 3)} vs "
        f"{fmt(rr.short.ttft_p95, ' s', 3)}: {fmt(head.short_p95_ratio, 'x', 1)} lower, "
        f"target >= {SHORT_P95_RATIO:.0f}x: {verdict(head.short_ok)}"
    )
    out(
        f"- output throughput {k.throughput:,.0f} vs {rr.throughput:,.0f} tok/s = "
        f"{fmt(head.throughput_ratio, '', 3)}, target within {THROUGHPUT_BAND:.0%}: "
        f"{verdict(head.throughput_ok)}"
    )
    out(
        f"- long p95 TTFT {fmt(k.long.ttft_p95, ' s')} vs {fmt(rr.long.ttft_p95, ' s')}: "
        f"{fmt(head.long_p95_ratio, 'x', 1)} higher, with {k.long.shed} of {k.long.arrived} "
        f"long requests ({k.long.shed_share:.0%}) shed at the 30 s queue deadline"
    )
    out(
        f"- the short pool's queue held at most {k.short_queue_max} requests at a tick "
        "(spill to the long pool, not simulated, acts only while it holds some)\n"
    )
    out("## (c) The long pool: token-budget vs count-only admission, same traffic\n")
    out(
        "| long-pool admission | preemptions | long p50 TTFT | long p95 TTFT | long shed "
        "| output tok/s |"
    )
    out("|---|---:|---:|---:|---:|---:|")
    for name, run in (
        (f"token budget + {REQUEST_LIMIT} requests", k),
        (f"count only, {REQUEST_LIMIT} requests", result.count_only),
        (f"count only, {LONG_COUNT_LIMIT} requests (info)", result.count_only_tight),
    ):
        out(
            f"| {name} | {run.long_pool_preemptions} | {fmt(run.long.ttft_p50, ' s')} "
            f"| {fmt(run.long.ttft_p95, ' s')} | {run.long.shed} ({run.long.shed_share:.0%}) "
            f"| {run.throughput:,.0f} |"
        )
    ok = verdict(result.preemptions_ok)
    out(f"\n- zero preemptions with the token budget, some without: {ok}\n")
    if not sensitivity:
        return
    out("## Sensitivity: the headline comparison at other rates\n")
    out(
        "| rate | short p95 kneecap / round-robin | lower by | throughput ratio "
        "| long p95 kneecap / round-robin | long shed (kneecap) |"
    )
    out("|---|---:|---:|---:|---:|---:|")
    for c in sorted((*sensitivity, head), key=lambda c: c.rate):
        kk, r = c.kneecap, c.round_robin
        out(
            f"| {c.rate:.2f} req/s ({c.rate / cap:.0%}) "
            f"| {fmt(kk.short.ttft_p95, ' s', 3)} / {fmt(r.short.ttft_p95, ' s', 3)} "
            f"| {fmt(c.short_p95_ratio, 'x', 1)} | {fmt(c.throughput_ratio, '', 3)} "
            f"| {fmt(kk.long.ttft_p95, ' s', 1)} / {fmt(r.long.ttft_p95, ' s', 1)} "
            f"| {kk.long.shed_share:.0%} |"
        )
    out("")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, no sensitivity")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()

    def out(line: str) -> None:
        print(line, flush=True)

    kv = get_profile(PROFILE).kv_tokens
    budget = token_budget(configured=None, kv_capacity=kv, kv_fraction=KV_FRACTION, default=None)
    out(f"# Routing acceptance ({'quick' if args.quick else 'full'})\n")
    out(
        f"3 x {PROFILE} (KV cache {kv:,} tokens, token budget {budget:,}); "
        f"{CHAT_SHARE:.0%} chat ({CHAT_PROMPT:,}-token prompts) + {1 - CHAT_SHARE:.0%} RAG "
        f"({RAG_PROMPT[0]:,}-{RAG_PROMPT[1]:,}-token prompts), {OUTPUT} output tokens each. "
        f"kneecap: static limit {REQUEST_LIMIT} requests per backend, token budget on, "
        "headroom router. TTFT from arrival (queue wait included).\n"
    )
    report(plan, *run_acceptance(plan), out)
    out(f"({time.perf_counter() - started:.1f} s of wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
