"""The virtual-clock driver, against a fake engine with exactly known timing,
and (when the simulator's engine is present) a short sweep on a real profile."""

from __future__ import annotations

import argparse
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
from gateway.bench.stats import summarize
from gateway.bench.workload import PromptMix, SyntheticWorkload

STEP = 0.01


class FakeEngine:
    """Every running request gets one token per 10 ms step; no capacity limit."""

    def __init__(self) -> None:
        self._now = 0.0
        self._end: float | None = None
        self._running: list[list[Any]] = []
        self.submitted: list[GenerationRequest] = []

    @property
    def now(self) -> float:
        return self._now

    def submit(self, request: GenerationRequest, listener: Any) -> None:
        self.submitted.append(request)
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
