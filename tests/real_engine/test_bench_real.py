"""`kneecap bench` against the real engine, directly and through the gateway (`--compare`).

The figures are the CPU's, not a GPU's: only their consistency is checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import Gateway
from tests.real_engine.conftest import (
    BACKEND,
    RealVllm,
    Samples,
    scrape,
    start_real_gateway,
    total,
)

ROOT = Path(__file__).resolve().parents[2]
LOADS = [1, 2, 4, 8]
REQUESTS = 8  # counted per point
OUTPUT_TOKENS = 16
PROMPT_TOKENS = 64
# The probe asks for one token, and with a byte-level tokenizer about 1 in 20 tokens is
# part of a UTF-8 character, which streams as no text: the probe then fails ("stream ended
# without output"). A bench bug, not this test's subject: such a run is tried again once.
PROBE_FLAKE = "probe request failed: stream ended without output"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, real_vllm: RealVllm) -> Iterator[Gateway]:
    # A limit as large as the sweep's largest load, so the gateway relays and never queues.
    gw = start_real_gateway(tmp_path_factory.mktemp("real-bench"), real_vllm, limit=max(LOADS))
    try:
        yield gw
    finally:
        gw.proc.stop()


def run_bench(
    args: list[str], gateway: Gateway
) -> tuple[subprocess.CompletedProcess[str], Samples, Samples]:
    """The finished run, with the gateway's metrics before and after it."""
    command = [sys.executable, "-m", "gateway.cli", "bench", *args]
    for _ in range(2):
        before = scrape(gateway.url + "/metrics")
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )
        after = scrape(gateway.url + "/metrics")
        if PROBE_FLAKE not in result.stderr:
            break
    return result, before, after


def test_sweep_direct_and_through_the_gateway(
    gateway: Gateway, real_vllm: RealVllm, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    result, before, after = run_bench(
        [
            "--url", real_vllm.base_url,
            "--compare", gateway.url + "/v1",
            "--model", real_vllm.model,
            "--concurrency", ",".join(map(str, LOADS)),
            "--requests", str(REQUESTS),
            "--prompt-tokens", str(PROMPT_TOKENS),
            "--output-tokens", str(OUTPUT_TOKENS),
            "--json", str(out),
            "--quiet",
        ],
        gateway,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"compare: A = {real_vllm.base_url}" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kneecap-bench/1"

    targets = [real_vllm.base_url, gateway.url + "/v1"]
    points = doc["points"]
    assert [(p["target"], p["load"]) for p in points] == [(t, n) for t in targets for n in LOADS]
    for p in points:
        assert_sane(p)
    # The engine tokenizes: the direct target's prompts were fitted to its own count.
    assert (
        f"{PROMPT_TOKENS}-token prompts: /tokenize counts {PROMPT_TOKENS}"
        in doc["notes"][targets[0]]
    )

    rows = doc["comparison"]
    assert [r["load"] for r in rows] == LOADS
    for row in rows:
        for metric in ("output_tok_s", "ttft_p50_ms", "e2e_p50_ms"):
            cell = row[metric]
            assert cell["a"] > 0 and cell["b"] > 0
            assert cell["ratio"] == pytest.approx(cell["b"] / cell["a"], rel=1e-3)

    # Everything B measured went through the gateway, every token of it counted from usage;
    # the only other outcome is the fillers the bench drops at the end of each point.
    requests = "kneecap_requests_total"
    grew = {
        status: total(after, requests, backend=BACKEND, status=status)
        - total(before, requests, backend=BACKEND, status=status)
        for status in ("ok", "client_closed")
    }
    every = total(after, requests, backend=BACKEND) - total(before, requests, backend=BACKEND)
    ok = grew["ok"]
    assert ok >= len(LOADS) * REQUESTS
    assert every == ok + grew["client_closed"]
    tokens = total(after, "kneecap_completion_tokens_total", backend=BACKEND) - total(
        before, "kneecap_completion_tokens_total", backend=BACKEND
    )
    # All but the probe (shorter) ran OUTPUT_TOKENS with ignore_eos.
    assert OUTPUT_TOKENS * (ok - 1) < tokens <= OUTPUT_TOKENS * ok


def assert_sane(point: dict[str, Any]) -> None:
    where = f"{point['target']} at {point['load']}"
    assert (point["requests"], point["errors"]) == (REQUESTS, 0), where
    # Exact, from the engine's usage: ignore_eos makes every answer max_tokens long.
    assert point["output_tokens_mean"] == OUTPUT_TOKENS, where
    assert point["prompt_tokens_mean"] >= PROMPT_TOKENS / 2, where
    assert point["duration_s"] > 0 and point["request_s"] > 0, where
    assert point["output_tok_s"] > 0 and point["total_tok_s"] > point["output_tok_s"], where
    ttft, e2e, tpot = point["ttft_ms"], point["e2e_ms"], point["tpot_ms"]
    assert 0 < ttft["p50"] <= e2e["p50"], where
    assert 0 < ttft["mean"] < e2e["mean"], where
    assert ttft["p50"] <= ttft["p95"] <= ttft["p99"], where
    assert tpot["mean"] >= 0, where
