"""The virtual-clock driver, against a fake engine with exactly known timing,
and (when the simulator's engine is present) a short sweep on a real profile."""

from __future__ import annotations

import argparse
import heapq
import io
import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from backends.sim.base import GenerationRequest, TokenEvent
from gateway.bench import command
from gateway.bench.phase import LoadPoint
from gateway.bench.progress import ProgressDisplay
from gateway.bench.simtarget import SimTarget
from gateway.bench.stats import percentile, summarize
from gateway.bench.sweep import SweepPlan
from gateway.bench.workload import PromptMix, SyntheticWorkload

STEP = 0.01


class FakeEngine:
    """Every running request gets one token per 10 ms step; no capacity limit."""

    def __init__(self) -> None:
        self._now = 0.0
        self._end: float | None = None
        self._running: list[list[Any]] = []
        self.submitted: list[GenerationRequest] = []
        self.sent: list[tuple[float, bool]] = []  # (when, counted) per request

    @property
    def now(self) -> float:
        return self._now

    def submit(self, request: GenerationRequest, listener: Any) -> None:
        self.submitted.append(request)
        self.sent.append((self._now, listener.ticket.counted))
        self._running.append([request, listener, 0])
        if self._end is None:
            self._end = self._now + STEP

    def next_time(self) -> float | None:
        return self._end

    def advance(self) -> None:
        assert self._end is not None
        self._now = self._end
        for item in list(self._running):
            request, listener, index = item
            last = index + 1 == request.max_tokens
            listener.on_token(self._now, TokenEvent(index, "length" if last else None))
            item[2] += 1
            if last:
                self._running.remove(item)
        self._end = self._now + STEP if self._running else None

    def advance_to(self, t: float) -> None:
        while self._end is not None and self._end <= t:
            self.advance()
        self._now = max(self._now, t)


def _run_point(point: LoadPoint, tokens: int = 5) -> tuple[Any, list[FakeEngine]]:
    engines: list[FakeEngine] = []

    def make(seed: int) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[-1]

    target = SimTarget("sim:fake", make)
    workload = SyntheticWorkload(PromptMix((128,), (1.0,)), tokens)

    async def go() -> Any:
        return await target.run_point(point, workload, ProgressDisplay(None))

    return anyio.run(go), engines


def test_closed_loop_on_virtual_time_is_exact() -> None:
    point = LoadPoint("concurrency", 4, requests=10, warmup=4)
    phase, engines = _run_point(point)
    assert len(phase.records) == 10
    for r in phase.records:
        assert r.ttft == pytest.approx(STEP) and r.e2e == pytest.approx(5 * STEP)
        assert list(r.itls) == pytest.approx([STEP] * 4)
        assert (r.output_tokens, r.prompt_tokens, r.prompt_class) == (5, 128, 128)
    s = summarize(
        phase.records,
        workload="128",
        load_kind="concurrency",
        load=4,
        window_s=phase.window_s,
        window_output_tokens=phase.window_tokens,
    )
    assert s.output_tok_s == pytest.approx(4 / STEP)  # four streams, a token each per step
    # Warm-up 4 + counted 10 + fillers: waves stay in lockstep here, so the third
    # wave holds 2 fillers, and up to 3 replace requests finishing with the last.
    assert 14 <= len(engines[0].submitted) <= 19
    assert all(r.ignore_eos and r.max_tokens == 5 for r in engines[0].submitted)


def test_a_staggered_closed_loop_starts_its_clients_apart_and_counts_no_ramp() -> None:
    point = LoadPoint("concurrency", 3, requests=6, warmup=0, stagger=0.035)
    phase, engines = _run_point(point, tokens=10)  # a request lasts 0.1 s
    sent = engines[0].sent
    assert [t for t, _ in sent[:3]] == pytest.approx([0.0, 0.035, 0.07])
    # Even with --warmup 0 the ramp is warm-up: the load is not complete before 0.07.
    assert not any(counted for _, counted in sent[:3])
    assert all(t >= 0.07 for t, counted in sent if counted)
    assert len(phase.records) == 6


def test_open_loop_on_virtual_time() -> None:
    point = LoadPoint("rate", 10, requests=20, warmup=2, arrival="constant")
    phase, _ = _run_point(point)
    assert len(phase.records) == 20
    assert all(r.ttft == pytest.approx(STEP) for r in phase.records)
    s = summarize(
        phase.records,
        workload="128",
        load_kind="rate",
        load=10,
        window_s=phase.window_s,
        window_output_tokens=phase.window_tokens,
    )
    assert s.request_s == pytest.approx(10, rel=0.06)
    assert s.output_tok_s == pytest.approx(50, rel=0.06)


def test_duration_bounds_the_counted_requests() -> None:
    point = LoadPoint("concurrency", 2, duration=0.5, warmup=0)
    phase, _ = _run_point(point, tokens=10)
    # Each stream finishes a request every 0.1 s: 2 x 5 in half a second (+ the tail).
    assert 10 <= len(phase.records) <= 12
    assert 0.5 <= phase.window_s <= 0.62


def test_unknown_profile_is_a_one_line_error() -> None:
    pytest.importorskip("backends.sim.virtual")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    err = io.StringIO()
    code = command.run(parser.parse_args(["--sim", "nope/x"]), stdout=io.StringIO(), stderr=err)
    assert code == 2 and err.getvalue().count("\n") == 1
    assert "unknown simulator profile 'nope/x'" in err.getvalue()


def test_default_workload_is_the_simulators_calibration_workload() -> None:
    calibration = pytest.importorskip("backends.sim.calibration")
    assert command.DEFAULT_OUTPUT_TOKENS == calibration.OUTPUT_TOKENS


def test_acceptance_sweep_places_the_knee_between_24_and_48(tmp_path: Path) -> None:
    pytest.importorskip("backends.sim.virtual")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(
        [
            "--sim",
            "qwen3-4b/l40s/bf16/vllm",
            "--concurrency",
            "1,8,16,32,48,64,96",
            "--prompt-tokens",
            "1024",
            "--slo",
            "ttft_p95_ms=500",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    started = time.monotonic()
    assert command.run(args, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    assert time.monotonic() - started < 60
    doc = json.loads(out.read_text())
    assert 24 <= doc["knee"]["load"] <= 48
    tps = {p["load"]: p["output_tok_s"] for p in doc["points"]}
    assert 60 < tps[1] < 90  # one stream on an L40S: ~74 tok/s in the field
    assert tps[64] < 1.25 * tps[32]  # the knee's shape: little throughput left past 32
    assert all(p["errors"] == 0 for p in doc["points"])


class LateClients:
    """A simulated engine whose clients hear each request's end ``delay`` seconds late.

    Over HTTP a closed-loop client's next request reaches the engine some time
    after the step that ended the last one (the stream's last bytes, the
    client's turnaround, the new request's bytes): at ``kneecap sim --speed 20``
    a third of a millisecond of wall time is ~7 ms of simulated time, about
    half a decode step at 8 in flight. Here the replacement goes out that late.
    """

    def __init__(self, engine: Any, delay: float) -> None:
        self._engine = engine
        self._delay = delay
        self._ends: list[tuple[float, int, Any, TokenEvent]] = []

    @property
    def now(self) -> float:
        return float(self._engine.now)

    def submit(self, request: GenerationRequest, listener: Any) -> None:
        engine = self

        class Relay:
            def on_token(self, now: float, event: TokenEvent) -> None:
                if event.finish_reason is None:
                    listener.on_token(now, event)
                else:
                    heapq.heappush(
                        engine._ends, (now + engine._delay, len(engine._ends), listener, event)
                    )

        self._engine.submit(request, Relay())

    def _end_first(self) -> bool:
        """A late end is due before (or with) the engine's next step."""
        step = self._engine.next_time()
        return bool(self._ends) and (step is None or self._ends[0][0] <= step)

    def next_time(self) -> float | None:
        return self._ends[0][0] if self._end_first() else self._engine.next_time()

    def advance(self) -> None:
        if self._end_first():
            at, _, listener, event = heapq.heappop(self._ends)
            self._engine.advance_to(at)
            listener.on_token(at, event)
        else:
            self._engine.advance()

    def advance_to(self, t: float) -> None:
        while (due := self.next_time()) is not None and due <= t:
            self.advance()
        self._engine.advance_to(t)


@pytest.mark.parametrize("load", [8, 16])
def test_a_late_client_never_moves_a_ttft_percentile_by_a_prefill(load: int) -> None:
    """The closed loop's figures must not hinge on a fraction of a step of client latency.

    Started all at once, the clients finish in adjacent engine steps for good
    (fixed output lengths keep their phases), and whether one client's next
    request lands before or after its neighbour's end decided which of them is
    prefilled first: at 8 in flight 20 ms of lateness moved TTFT p50 from 155
    to 238 ms (two prefills share a step), what failed the clock check one run
    in four. Staggered, each client's request is prefilled alone whatever the
    lateness: TTFT (from the send) only loses the part of a step it waited less.
    """
    virtual = pytest.importorskip("backends.sim.virtual")
    profiles = pytest.importorskip("backends.sim.profiles")
    profile = profiles.get_profile("qwen3-4b/l40s/bf16/vllm")
    plan = SweepPlan(kind="concurrency", loads=(1, 8, 16, 32, 48, 64, 96))
    point = plan.point(load, plan.loads.index(load))  # as the acceptance sweep runs it
    workload = SyntheticWorkload(PromptMix((1024,), (1.0,)), 2816)

    def ttft_ms(delay: float) -> tuple[float, float]:
        target = SimTarget(
            "sim", lambda seed: LateClients(virtual.VirtualEngine(profile, seed=seed), delay)
        )
        phase = anyio.run(target.run_point, point, workload, ProgressDisplay(None))
        ttfts = [r.ttft * 1e3 for r in phase.records if r.ttft is not None]
        return percentile(ttfts, 50), percentile(ttfts, 95)

    p50, p95 = ttft_ms(0.0)
    for delay_ms in (5, 10, 15, 20, 25, 30, 40):
        late50, late95 = ttft_ms(delay_ms / 1e3)
        assert late50 <= 1.1 * p50, (delay_ms, late50, p50)
        assert late95 <= 1.1 * p95, (delay_ms, late95, p95)
