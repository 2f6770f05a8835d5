"""Command-line values refused up front: repeated bench series, NaN weights, bad sim delays,
an empty config path.

Each drives the real command line (a subprocess), except the knee's arithmetic on
a curve with two points at one load, which is pure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.bench.knee import CurvePoint, find_knee
from tests.procs import MODEL, Proc, free_port, served, start_sim

PROFILE = "qwen3-4b/l40s/bf16/vllm"
REPO = Path(__file__).resolve().parent.parent
QUICK = ("--concurrency", "1,2", "--requests", "2", "--output-tokens", "8", "--quiet")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``kneecap ARGS``; a command still running after ``timeout`` accepted its values."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:  # run() has killed it
        pytest.fail(f"kneecap {' '.join(args)} was accepted: still running after {timeout} s")


def one_bench_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kneecap bench: error: "), result.stderr
    return lines[0]


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path, ttft_ms=1, itl_ms=1))


# -- repeated series: refused before the sweep, not a ZeroDivisionError after it ------------


def test_a_repeated_prompt_length_is_refused_before_the_sweep(tmp_path: Path) -> None:
    out = tmp_path / "dup.json"
    result = cli(
        "bench", "--sim", PROFILE, *QUICK, "--prompt-tokens", "1024,1024", "--json", str(out)
    )
    assert "1024 given more than once" in one_bench_error(result)
    assert result.stdout == ""  # no report: nothing was measured
    assert not out.exists()


def test_a_repeated_length_in_a_mix_is_refused() -> None:
    result = cli("bench", "--sim", PROFILE, *QUICK, "--prompt-tokens", "1024:0.5,1024:0.5")
    assert "1024 given more than once" in one_bench_error(result)


def test_comparing_a_simulated_target_with_itself_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    args = ("--sim", PROFILE, "--compare", f"sim:{PROFILE}", "--json", str(out))
    result = cli("bench", *args, *QUICK)
    assert f"--compare sim:{PROFILE}: the same target as --sim" in one_bench_error(result)
    assert result.stdout == ""
    assert not out.exists()


def test_an_empty_profile_is_one_error_line() -> None:
    # `--sim "$PROFILE"` with PROFILE unset fell through to the absent --url: AttributeError.
    result = cli("bench", "--sim", "", *QUICK)
    assert "unknown simulator profile ''" in one_bench_error(result)


def test_an_empty_compare_target_is_one_error_line() -> None:
    # `--compare "$URL"` with URL unset ran the sweep without its B target.
    result = cli("bench", "--sim", PROFILE, "--compare", "", *QUICK)
    assert "bad URL ''" in one_bench_error(result)
    assert result.stdout == ""


@pytest.mark.parametrize("spelling", ["{url}", "{url}/v1/"])
def test_comparing_an_endpoint_with_itself_is_refused(sim: Proc, spelling: str) -> None:
    again = spelling.format(url=sim.url)
    result = cli("bench", "--url", sim.url, "--compare", again, *QUICK)
    assert f"--compare {again}: the same target as --url" in one_bench_error(result)


def test_two_different_simulated_targets_still_compare(tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    other = "qwen3-4b/l40s/bf16/sglang"
    args = ("--sim", PROFILE, "--compare", f"sim:{other}", "--json", str(out))
    result = cli("bench", *args, *QUICK, "--prompt-tokens", "1024,2048")
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert len(document["comparison"]) == 4  # two series at two loads


def test_the_marginal_knee_reads_two_points_at_one_load_as_their_mean() -> None:
    # Two measurements at one load made the slope between them 0 / 0.
    curve = [
        CurvePoint(1.0, 100.0),
        CurvePoint(1.0, 120.0),
        CurvePoint(2.0, 220.0),
        CurvePoint(4.0, 230.0),
        CurvePoint(4.0, 234.0),
    ]
    knee = find_knee(curve, "concurrency")
    assert knee.load == 2.0
    assert "initial 110.0" in knee.marginal.reason  # the mean at load 1
    assert "adds 6.0 tok/s" in knee.marginal.reason  # from the means: (232 - 220) / 2

    only_one_load = find_knee([CurvePoint(8.0, 500.0), CurvePoint(8.0, 520.0)], "concurrency")
    assert only_one_load.load is None
    assert "at least two loads" in only_one_load.marginal.reason


# -- weights that are no finite number --------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("1024:nan,8192:1", "weight >= 0 (a finite number)"),
        ("1024:inf,8192:1", "weight >= 0 (a finite number)"),
        ("1024:1e308,8192:1e308", "weights too large"),  # each finite, their sum is not
    ],
)
def test_a_weight_that_is_no_finite_number_is_one_error_line(spec: str, said: str) -> None:
    result = cli("bench", "--sim", PROFILE, *QUICK, "--prompt-tokens", spec)
    assert said in one_bench_error(result)


# -- kneecap sim: delays --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--itl-ms", "-5"),
        ("--itl-ms", "nan"),
        ("--itl-ms", "inf"),
        ("--ttft-ms", "-5"),
        ("--ttft-ms", "nan"),
        ("--ttft-ms", "inf"),
        ("--ttft-ms", "soon"),
    ],
)
def test_sim_refuses_a_delay_that_is_no_non_negative_number(flag: str, value: str) -> None:
    result = cli("sim", "--port", str(free_port()), flag, value, timeout=20)
    assert result.returncode == 2, result.stderr
    assert f"argument {flag}: {value!r} is not a non-negative number" in result.stderr
    assert "Traceback" not in result.stderr


def test_sim_streams_every_token_with_zero_delays(tmp_path: Path) -> None:
    proc = start_sim(tmp_path, ttft_ms=0, itl_ms=0)
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body, timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        proc.stop()
    assert events[-1] == "data: [DONE]"
    assert sum('"content"' in e for e in events) >= 4
    assert "Error" not in proc.output()


# -- an empty config path -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["", "  "])
def test_serve_refuses_an_empty_config_path(path: str) -> None:
    # `--config "$CFG"` with CFG unset started the embedded simulated backends.
    result = cli("serve", "--config", path, "--port", str(free_port()), timeout=20)
    assert result.returncode == 2, result.stdout
    assert "argument --config: the config path is empty" in result.stderr
    assert "simulated" not in result.stdout


@pytest.mark.parametrize("path", ["", "  "])
def test_check_config_refuses_an_empty_path(path: str) -> None:
    # It validated the embedded default and said ok.
    result = cli("check-config", path)
    assert result.returncode == 2
    assert "argument file: the config path is empty" in result.stderr
    assert "ok" not in result.stdout
