"""``kneecap bench --requests-file req.jsonl``: the series reads "prompts from req.jsonl"
in the table, the progress lines and the emitted policy, not "req.jsonl-token prompts";
a synthetic series still reads "1024-token prompts"."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_cli_bench_fixes import PROFILE, cli

# Enough load that the SLO fails at the top, so a knee (and a policy) comes out.
SWEEP = ("--concurrency", "1,64,256", "--requests", "4", "--output-tokens", "8")


def test_a_replayed_workload_reads_as_prompts_from_its_file(tmp_path: Path) -> None:
    requests = tmp_path / "req.jsonl"
    bodies = [{"prompt": "hello there"}, {"messages": [{"role": "user", "content": "hi"}]}]
    requests.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    policy = tmp_path / "policy.yaml"
    result = cli(
        "bench", "--sim", PROFILE, *SWEEP, "--slo", "ttft_p95_ms=30",
        "--requests-file", str(requests), "--emit-policy", str(policy),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    everything = result.stdout + result.stderr + policy.read_text()
    assert "-token prompts" not in everything
    assert f"{PROFILE} · prompts from req.jsonl · load = concurrency" in result.stdout
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 3
    assert all(" · prompts from req.jsonl · c=" in line for line in progress)
    assert "# prompts from req.jsonl: knee 64 (slo)" in policy.read_text()


def test_a_synthetic_workload_still_reads_as_token_prompts(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    result = cli(
        "bench", "--sim", PROFILE, *SWEEP, "--slo", "ttft_p95_ms=1000",
        "--prompt-tokens", "1024:0.5,2048:0.5", "--emit-policy", str(policy),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "1024:0.5,2048:0.5-token prompts · load = concurrency" in result.stdout
    assert " · 1024:0.5,2048:0.5-token prompts · c=1 · " in result.stderr
    assert "# 1024:0.5,2048:0.5-token prompts: knee" in policy.read_text()
