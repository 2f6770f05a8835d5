"""Regressions in ``kneecap bench``: pre-opened connections, output files, option values, policy.

Each drives the real command line (a subprocess) or the real client against real
sockets; the policy's arithmetic is checked on a virtual-clock sweep and on a
scripted phase.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.bench.h1 import Client
from gateway.bench.phase import LoadPoint, Phase
from gateway.bench.stats import RequestRecord
from tests.polling import eventually
from tests.procs import MODEL, Gateway, start_gateway

PROFILE = "qwen3-4b/l40s/bf16/vllm"
NEVER_RETRIEVED = "exception was never retrieved"


def bench(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parent.parent,
    )


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kneecap bench: error: "), stderr
    return lines[0]


# -- pre-opened connections that close before use ------------------------------------------


async def preopen_and_lose(hanging_up: str, waiting: str) -> None:
    """Pre-open connections that end unused: one server hangs up, the client closes the rest."""
    dropped, closed = Client(hanging_up), Client(waiting)
    await dropped.preconnect(4)
    await closed.preconnect(2)
    conns = [*dropped._idle, *closed._idle]
    await eventually(lambda: all(c.closed for c in dropped._idle), "the server did not hang up")
    await closed.aclose()
    await dropped.aclose()
    # connection_lost, where a close meets the connection's state, has run for every one.
    await eventually(lambda: all(c.transport is None for c in conns), "a close is pending")


@pytest.mark.anyio
async def test_a_preopened_connection_closed_before_use_leaves_no_unretrieved_error() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # as a server shedding load, or timing out idle keep-alives, does

    async def wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes

    servers = [await asyncio.start_server(h, "127.0.0.1", 0) for h in (hang_up, wait)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    try:
        async with servers[0], servers[1]:
            await preopen_and_lose(*urls)
            gc.collect()  # a future's unretrieved error is reported when it is collected
    finally:
        loop.set_exception_handler(None)
    assert not [c for c in reported if NEVER_RETRIEVED in str(c.get("message"))], reported


@pytest.fixture(scope="module")
def shedding_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Two requests at a time, one queued: a closed loop of 16 is mostly answered 429."""
    config = {
        "listen": {"drain_timeout_s": 1},
        "pools": {"short": {"max_queue_depth": 1, "max_queue_wait_s": 1}},
        "admission": {"limit": {"kind": "static", "initial": 2, "max": 2}},
        "backends": [{"name": "fx", "models": [MODEL], "sim": {"ttft_ms": 20, "itl_ms": 5}}],
    }
    gateway = start_gateway(tmp_path_factory.mktemp("shed"), config)
    try:
        yield gateway
    finally:
        gateway.proc.stop()


def test_bench_against_a_shedding_gateway_prints_no_asyncio_errors(
    shedding_gateway: Gateway,
) -> None:
    result = bench(
        "--url",
        shedding_gateway.url,
        "--concurrency",
        "16",
        "--requests",
        "20",
        "--output-tokens",
        "64",
        "--prompt-tokens",
        "256",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert "HTTP 429" in result.stdout  # it did meet the shedding
    assert NEVER_RETRIEVED not in result.stderr, result.stderr[:2000]
    assert result.stderr == ""


# -- output files ----------------------------------------------------------------------------


QUICK_SWEEP = (
    "--sim",
    PROFILE,
    "--concurrency",
    "1,8,16",
    "--requests",
    "32",
    "--slo",
    "ttft_p95_ms=80",
    "--quiet",
)


def outputs(tmp_path: Path, plot: str) -> tuple[list[str], dict[str, Path]]:
    files = {
        "json": tmp_path / "r.json",
        "csv": tmp_path / "r.csv",
        "emit-policy": tmp_path / "policy.yaml",
    }
    args = [a for option, path in files.items() for a in (f"--{option}", str(path))]
    return [*args, "--plot", plot], files


@pytest.mark.parametrize(
    ("name", "path_only", "said"),
    [
        ("x.plot", False, "matplotlib cannot write .plot files (use .avif, "),
        ("x.pgf", True, "a .pgf plot needs xelatex, which is not installed"),
    ],
)
def test_a_plot_matplotlib_cannot_write_is_refused_before_the_sweep(
    tmp_path: Path, name: str, path_only: bool, said: str
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "adir").mkdir()
    args, files = outputs(tmp_path, str(tmp_path / name))
    # Without TeX on the PATH (only Python's own directory): .pgf cannot be written.
    env = {"PATH": str(Path(sys.executable).parent)} if path_only else None
    result = bench(*QUICK_SWEEP, *args, env=env)
    assert result.returncode == 2
    assert said in one_error_line(result.stderr)
    assert result.stdout == ""  # refused up front: no sweep ran
    assert not any(path.exists() for path in files.values())


def test_an_output_path_that_is_a_directory_is_refused_before_the_sweep(tmp_path: Path) -> None:
    result = bench(*QUICK_SWEEP, "--json", str(tmp_path))
    assert result.stdout == ""  # no sweep ran
    assert result.returncode == 2
    assert f"--json {tmp_path}: is a directory" in one_error_line(result.stderr)


def test_a_plot_that_fails_after_the_sweep_costs_no_other_output(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    full = tmp_path / "plot.png"
    full.symlink_to("/dev/full")  # a .png path that passes every check, then cannot be written
    args, files = outputs(tmp_path, str(full))
    result = bench(*QUICK_SWEEP, *args)
    assert result.returncode == 2
    assert one_error_line(result.stderr).endswith("plot.png: No space left on device")
    assert "knee at" in result.stdout
    assert json.loads(files["json"].read_text())["schema"] == "kneecap-bench/1"
    assert files["csv"].read_text().startswith("target,")
    assert yaml.safe_load(files["emit-policy"].read_text())["admission"]["limit"]["initial"] > 0


def test_a_plot_tool_that_fails_late_is_one_line_and_costs_no_other_output(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    tools = tmp_path / "bin"
    tools.mkdir()
    tex = tools / "xelatex"
    tex.write_text("#!/bin/sh\nexit 1\n")  # present for the check, broken when run
    tex.chmod(0o755)
    args, files = outputs(tmp_path, str(tmp_path / "plot.pgf"))
    result = bench(*QUICK_SWEEP, *args, env={"PATH": f"{tools}:{os.environ['PATH']}"})
    assert result.returncode == 2
    # TeX exits at once: matplotlib reads its failure (LatexError) or finds the pipe it
    # feeds closed first (BrokenPipeError), as the two processes race. Either is the tool's.
    line = one_error_line(result.stderr)
    assert "--plot" in line and ("LatexError" in line or "BrokenPipeError" in line), line
    assert "Traceback" not in result.stderr
    assert all(path.exists() for path in files.values())


# -- option values that are not finite ------------------------------------------------------


QUICK = ("--requests", "4", "--output-tokens", "8")  # were a bad value let through


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--rate", "nan", *QUICK), "--rate 'nan': give positive values"),
        (("--rate", "inf", *QUICK), "--rate 'inf': give positive values (finite numbers)"),
        (("--rate", "0.5,nan", *QUICK), "give positive values"),
        (("--rate", "1e308", "--output-tokens", "8"), "--rate 1e+308: too large"),
        (("--concurrency", "nan", *QUICK), "--concurrency 'nan': give positive values"),
        (("--concurrency", "2", "--duration", "nan"), "--duration must be positive and finite"),
        (("--concurrency", "2", "--duration", "inf"), "--duration must be positive and finite"),
        (
            ("--concurrency", "2", "--timeout", "nan", *QUICK),
            "--timeout must be positive and finite",
        ),
        (("--concurrency", "2", "--speed", "inf", *QUICK), "--speed must be positive and finite"),
        (("--concurrency", "2", "--stagger", "inf", *QUICK), "--stagger must be >= 0 and finite"),
        (("--slo", "ttft_p95_ms=nan", "--concurrency", "1", *QUICK), "must be positive"),
        (("--slo", "itl_p99_ms=inf", "--concurrency", "1", *QUICK), "must be positive"),
    ],
)
def test_non_finite_option_values_are_refused_in_one_line(args: tuple[str, ...], said: str) -> None:
    result = bench("--sim", PROFILE, *args, "--quiet", timeout=30)
    assert result.returncode == 2, result.stdout[-500:]
    assert said in one_error_line(result.stderr)


# -- the policy of a rate sweep --------------------------------------------------------------


def rate_policy(tmp_path: Path, requests: int) -> tuple[dict[str, Any], dict[str, Any]]:
    policy, report = tmp_path / f"policy{requests}.yaml", tmp_path / f"r{requests}.json"
    result = bench(
        "--sim",
        PROFILE,
        "--rate",
        "0.2",
        "--arrival",
        "constant",
        "--slo",
        "itl_p95_ms=25",
        "--requests",
        str(requests),
        "--emit-policy",
        str(policy),
        "--json",
        str(report),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    limit = yaml.safe_load(policy.read_text())["admission"]["limit"]
    return limit, json.loads(report.read_text())["points"][0]


def test_a_rate_sweeps_limit_is_the_load_it_held_however_few_the_requests(
    tmp_path: Path,
) -> None:
    short, point = rate_policy(tmp_path, 32)
    long, _ = rate_policy(tmp_path, 320)
    # 0.2 req/s of ~51 s requests, a point the engine keeps up with: by Little's law, with
    # the arrival rate, ~10.2 requests in flight. The measured req/s (0.15 over a window
    # that includes the last requests' drain) made it 8.
    held = point["load"] * point["e2e_ms"]["mean"] / 1e3
    assert point["request_s"] < 0.8 * point["load"]  # the drain is in the window
    assert short["initial"] >= held * 0.95
    assert short["initial"] == long["initial"]  # 32 requests or ten times as many
    assert point["in_flight_mean"] == pytest.approx(held, rel=0.05)
    assert short["initial"] == math.ceil(point["in_flight_mean"])


def test_a_closed_loop_point_holds_its_concurrency(tmp_path: Path) -> None:
    report = tmp_path / "c.json"
    result = bench(
        "--sim",
        PROFILE,
        "--concurrency",
        "1,4",
        "--requests",
        "16",
        "--output-tokens",
        "64",
        "--json",
        str(report),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    points = json.loads(report.read_text())["points"]
    assert [p["in_flight_mean"] for p in points] == [pytest.approx(1.0), pytest.approx(4.0)]


def test_the_mean_in_flight_is_taken_once_the_point_is_steady() -> None:
    # Open loop, no warm-up, 3 counted requests then fillers; each takes 10 s, one arrives
    # every 4 s (t = 0, 4, 8 counted; 12, 16 fillers), so the first finishes at t=10.
    phase = Phase(LoadPoint("rate", 0.25, requests=3, warmup=0))
    record = RequestRecord(10, 1, ttft=1.0, e2e=10.0)
    sent = (0.0, 4.0, 8.0, 12.0, 16.0)
    events = sorted([(t, 1, t) for t in sent] + [(t + 10.0, 0, t) for t in sent])
    tickets = {}
    for now, is_issue, when in events:  # at equal times a finish comes first
        if phase.done:
            break
        if is_issue:
            tickets[when] = phase.issue(now)
        else:
            phase.finish(tickets[when], record, now)
    assert phase.done and phase.window_s == 18.0  # first counted issue to last counted finish
    # Over the whole window the mean is 38/18 = 2.1: 1, 2 and 3 in flight while it fills.
    # From the first finish on it holds 0.25 x 10 = 2.5 (2 and 3 in turn), which is the load.
    assert phase.in_flight_mean == pytest.approx(2.5)
