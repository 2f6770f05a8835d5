"""The relay benchmark harness, in its tiny mode: every figure is produced (values not judged)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.perf.routers import parse_router

ROOT = Path(__file__).resolve().parent.parent


def test_relay_bench_quick_run_produces_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.perf.relay_bench",
            "--quick",
            "--no-pin",
            "--duration",
            "0.3",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    figures = {(row["scenario"][:3], row["figure"]): row for row in report["rows"]}
    expected = {
        ("(a)", "req/s"),
        ("(b)", "relayed chunks/s"),
        ("(c)", "TTFT p50 ms"),
        ("(c)", "TTFT p99 ms"),
        ("(c)", "ITL p99 ms"),
        ("(c)", "TTFT p50 ms via bare TCP hop"),
        ("(d)", "RSS MB at start"),
        ("(e)", "RSS MB while held"),
    }
    assert expected <= set(figures), sorted(figures)
    for key in expected:
        assert math.isfinite(figures[key]["gateway"]), key
    for key in [k for k in expected if k[0] in ("(a)", "(b)", "(c)")]:
        assert figures[key]["direct"] is not None and math.isfinite(figures[key]["direct"]), key
    phases = report["phases"]
    for name in ("nonstream", "stream", "paced"):
        for target in ("direct", "gateway"):
            phase = phases[name][target]
            assert phase["errors"] == 0, (name, target)
            assert {"gateway", "backend", "loadgen"} <= set(phase["cpu_percent"])
    assert phases["hold"]["gateway"]["released"] is True
    assert phases["measured_by_gateway"]["ttft_samples"] > 0
    # The gateway's own pre-send time is read from its request records: a part of the TTFT.
    presend = figures[("(c)", "receipt to upstream write p50 ms, gateway's own clock")]
    assert 0 < presend["gateway"] < figures[("(c)", "TTFT p50 ms")]["gateway"]
    # The printed table carries the same figures.
    assert "relayed chunks/s" in result.stdout and "via gateway" in result.stdout


def test_interleaved_comparison_of_two_checkouts_reports_its_ratio() -> None:
    """``gateway.perf.interleave`` against this very checkout, one slice pair: both
    gateways answer, and the summary is printed (the figure itself is not judged)."""
    command = ["gateway.perf.interleave", "--old", str(ROOT), "--no-pin", "--pairs", "1"]
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    throughput, cpu = result.stdout.strip().splitlines()[-2:]
    for summary, name in ((throughput, "req_s"), (cpu, "cpu_us_per_req")):
        assert summary.startswith(f"{name}: old mean"), result.stdout
        ratio = float(summary.split("new/old median ")[1].split()[0])
        assert 0 < ratio < 10


def test_interleaved_paced_comparison_reports_ttft_and_itl_tails() -> None:
    """The paced comparison prints, per figure, both sides' means and the median
    difference: TTFT p50 and p99, ITL p99, and the gateways' own receipt-to-write p50."""
    command = ["gateway.perf.interleave", "--old", str(ROOT), "--no-pin", "--pairs", "1"]
    result = subprocess.run(
        [sys.executable, "-m", *command, "--scenario", "paced"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    summaries = result.stdout.strip().splitlines()[-4:]
    names = ["ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "receipt_to_write_p50_ms"]
    for summary, name in zip(summaries, names, strict=True):
        assert summary.startswith(f"{name}: old mean"), result.stdout
        old_mean = float(summary.split("old mean ")[1].split(",")[0])
        assert old_mean > 0
        float(summary.split("new - old median ")[1].split()[0])  # a number, signed
    itl_p99 = float(summaries[2].split("old mean ")[1].split(",")[0])
    assert 15 <= itl_p99 < 100  # the backend's 15 ms pace, and then some


def test_interleave_runs_the_old_side_on_the_interpreter_given(tmp_path: Path) -> None:
    """``--old-python``: the old side's gateway runs on that interpreter (here a wrapper
    that leaves a mark, then runs this one), the new side on this one."""
    mark = tmp_path / "old-side-ran"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {mark}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    command = ["gateway.perf.interleave", "--old", str(ROOT), "--no-pin", "--pairs", "1"]
    result = subprocess.run(
        [sys.executable, "-m", *command, "--old-python", str(wrapper)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (invocation,) = mark.read_text().splitlines()  # one gateway: the old side's
    assert invocation.startswith("-m gateway.cli serve --config ")
    assert "old.yaml" in invocation


def test_another_router_runs_the_same_load_beside_the_gateway(tmp_path: Path) -> None:
    """``--router``: the bench's own bare TCP forwarder, started as any router would be,
    takes the same load as the gateway in each scenario and gets rows of its own."""
    out = tmp_path / "relay.json"
    relay = f"{sys.executable} -m gateway.perf.tcp_relay"
    hop = relay + " --port {port} --upstream-port {backend_port}"
    command = ["gateway.perf.relay_bench", "--quick", "--no-pin", "--duration", "0.3"]
    for scenario in ("nonstream", "stream", "paced", "idle"):
        command += ["--scenario", scenario]
    command += ["--router", f"hop={hop}", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {(row["scenario"][:3], row["figure"]): row for row in report["rows"]}
    for key in (
        ("(a)", "req/s via hop"),
        ("(b)", "relayed chunks/s via hop"),
        ("(c)", "TTFT p50 ms via hop"),
        ("(c)", "ITL p99 ms via hop"),
        ("(d)", "RSS MB at start, hop"),
    ):
        assert key in rows, sorted(rows)
        assert math.isfinite(rows[key]["gateway"]) and rows[key]["gateway"] > 0, key
    for name in ("nonstream", "stream", "paced"):
        phase = report["phases"][name]["hop"]
        assert phase["errors"] == 0 and phase["requests"] > 0, name
        assert "hop" in phase["cpu_percent"], phase["cpu_percent"]
    assert "via hop" in result.stdout


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("no-command", "expected NAME=COMMAND"),
        ("x=", "expected NAME=COMMAND"),
        ("gateway=relay --port {port}", "router name 'gateway'"),
        ("a b=relay --port {port}", "router name 'a b'"),
        ("r=relay --listen 8000", "must listen on {port}"),
        ("r=relay --port {port} --to {upstream}", "bad placeholder 'upstream'"),
        ("r=relay --port {port} '", "No closing quotation"),
    ],
)
def test_a_router_spec_that_cannot_run_is_refused_before_anything_starts(
    spec: str, complaint: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(complaint)):
        parse_router(spec)


def test_a_router_command_gets_its_ports_and_backend_filled_in() -> None:
    spec = parse_router("r=relay -p {port} --to {backend} --up {backend_port} -m {metrics_port}")
    filled = spec.filled(port=9001, backend="http://127.0.0.1:9002", metrics_port=9003)
    backend = "http://127.0.0.1:9002"
    assert filled == ["relay", "-p", "9001", "--to", backend, "--up", "9002", "-m", "9003"]
