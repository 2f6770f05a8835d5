"""The clock check (virtual vs HTTP) and the fast paths that make ``--speed 20`` measurable."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.sim import wire
from backends.sim.realtime import KernelTimer
from backends.sim.tokenizer import text_of_tokens
from gateway.bench.clockcheck import CpuShare, check_figure, check_points, render
from gateway.bench.prompts import ENDPOINTS, PromptText
from gateway.bench.stats import Latency, PointSummary
from gateway.bench.sweep import collector_paused

ROOT = Path(__file__).resolve().parent.parent


def point(load: float, tok_s: float, ttft_ms: float, itl_ms: float, e2e_s: float) -> PointSummary:
    def lat(seconds: float) -> Latency:
        return Latency(seconds, {50.0: seconds, 95.0: seconds * 1.5})

    return PointSummary(
        workload="1024",
        load_kind="concurrency",
        load=load,
        requests=32,
        errors=0,
        duration_s=100.0,
        request_s=0.3,
        output_tok_s=tok_s,
        total_tok_s=tok_s,
        prompt_tokens_mean=1024,
        output_tokens_mean=2816,
        ttft=lat(ttft_ms / 1e3),
        itl=lat(itl_ms / 1e3),
        tpot=lat(itl_ms / 1e3),
        e2e=lat(e2e_s),
    )


def test_a_figure_agrees_within_the_tolerance_either_way() -> None:
    assert check_figure("ttft_p50_ms", 100.0, 125.0, 0.25).ok
    assert check_figure("ttft_p50_ms", 100.0, 75.0, 0.25).ok
    high = check_figure("ttft_p50_ms", 100.0, 125.1, 0.25)
    assert not high.ok and high.ratio == pytest.approx(1.251)
    assert not check_figure("itl_p95_ms", 100.0, 74.9, 0.25).ok
    assert check_figure("itl_p95_ms", None, None, 0.25).ok  # neither run measured it
    missing = check_figure("itl_p95_ms", 13.0, None, 0.25)
    assert not missing.ok and missing.ratio is None


def test_every_figure_of_every_point_is_checked_and_rendered() -> None:
    virtual = [point(1, 75, 51, 13.4, 37.6), point(32, 1065, 238, 29.5, 84.3)]
    http = [point(1, 75, 64, 13.3, 37.6), point(32, 1064, 240, 45.0, 84.3)]
    share = CpuShare(sim=0.4, bench=0.3, others=0.9)
    rows = check_points(virtual, http, 0.25, [None, share])
    assert [r.load for r in rows] == [1, 32]
    assert [f.figure for f in rows[0].figures] == [
        "output_tok_s",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "itl_p50_ms",
        "itl_p95_ms",
        "e2e_p50_ms",
        "e2e_p95_ms",
    ]
    failed = {(r.load, f.figure) for r in rows for f in r.figures if not f.ok}
    assert failed == {
        (1, "ttft_p50_ms"),
        (1, "ttft_p95_ms"),
        (32, "itl_p50_ms"),
        (32, "itl_p95_ms"),
    }
    text = render(rows, 0.25)
    assert "TTFT p50 ms" in text and "1.25  ok" not in text and "1.25  FAIL" in text
    assert "other processes 0.90" in text
    assert text.rstrip().endswith(
        "10 of 14 figures within 25% of the virtual clock: the clocks DISAGREE"
    )
    with pytest.raises(ValueError, match="different loads"):
        check_points(virtual, http[:1], 0.25)


@pytest.mark.parametrize("chat", [True, False])
def test_token_chunks_are_the_bytes_the_json_encoder_would_write(chat: bool) -> None:
    ident = wire.Identity.for_request("chatcmpl" if chat else "cmpl", {"seed": 7, "x": "ü"})
    chunks = wire.TokenChunks(ident, "org/model-ü", chat)
    for seed in (0, 3, 12345):
        for index in range(25):
            for finish in (None, "length", "stop"):
                text = wire.token_text(seed, index)
                delta = {"content": text}
                expected = (
                    wire.chat_chunk(ident, "org/model-ü", delta, finish)
                    if chat
                    else wire.completion_chunk(ident, "org/model-ü", text, finish)
                )
                assert chunks.token(seed, index, finish) == expected


def test_prompt_fillers_are_built_once_and_unchanged() -> None:
    prompts = PromptText(ENDPOINTS["chat"])
    for seed in (0, 5, 8, 13, 1_000_003):
        text = prompts.text(1024, 42, seed)
        size = prompts.filler_bytes(1024)
        assert text[16:] == text_of_tokens(-(-size // 4), seed)[:size]
    assert sorted(prompts.fillers) == [(size, 0), (size, 3), (size, 5)]  # seeds mod 8


@pytest.mark.anyio
async def test_the_kernel_timer_never_wakes_early() -> None:
    """How late it wakes is a speed figure (the clock check prints its effect); that it
    never wakes early is behaviour."""
    timer = KernelTimer.open()
    if timer is None:
        pytest.skip("no timerfd here (not Linux)")
    try:
        late = []
        for _ in range(20):
            started = time.perf_counter()
            await timer.sleep(0.0007)
            late.append(time.perf_counter() - started - 0.0007)
        assert min(late) >= -1e-5
    finally:
        timer.close()


def test_the_check_command_runs_both_clocks_and_stops_its_simulator(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    args = ["--concurrency", "1,2", "--requests", "2", "--output-tokens", "24", "--no-pin"]
    done = subprocess.run(
        [sys.executable, "-m", "gateway.bench.clockcheck", *args, "--quiet", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a figure disagreed on this machine
    assert "out tok/s" in done.stdout and "figures within 25% of the virtual clock" in done.stdout
    document = json.loads(out.read_text())
    assert [p["load"] for p in document["points"]] == [1, 2]
    tok_s = document["points"][1]["figures"]["output_tok_s"]
    assert tok_s["virtual"] > 0 and tok_s["http"] > 0
    assert document["ok"] == (done.returncode == 0)


def test_no_collection_pauses_the_load_generator_while_a_point_is_measured() -> None:
    assert gc.isenabled()
    cycles_before = gc.get_stats()[2]["collections"]
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_stats()[2]["collections"] == cycles_before + 1  # one full pass after

    gc.disable()  # a caller that switched it off keeps it off
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
