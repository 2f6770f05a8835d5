"""One short real sweep through the gateway, compared with the same backend direct."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from gateway.bench import command
from tests.procs import MODEL, Gateway, Proc


def test_sweep_through_the_gateway_against_direct(
    gateway: Gateway, sims: list[Proc], tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "compare.json"
    args = parser.parse_args(
        [
            "--url",
            sims[0].url,
            "--compare",
            gateway.url + "/v1",
            "--model",
            MODEL,
            "--concurrency",
            "1,4",
            "--requests",
            "8",
            "--warmup",
            "1",
            "--prompt-tokens",
            "200",
            "--output-tokens",
            "8",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    stdout, stderr = io.StringIO(), io.StringIO()
    assert command.run(args, stdout=stdout, stderr=stderr) == 0, stderr.getvalue()
    doc = json.loads(out.read_text())
    assert len(doc["points"]) == 4
    for p in doc["points"]:
        assert (p["requests"], p["errors"]) == (8, 0)
        assert p["output_tokens_mean"] == 8
        assert p["prompt_tokens_mean"] == 200  # the backend's own usage count
        assert p["ttft_ms"]["p50"] >= 5  # the backends' fixed 5 ms TTFT
    rows = doc["comparison"]
    assert [r["load"] for r in rows] == [1, 4]
    # The gateway adds little: within 3x of direct TTFT plus a few ms on a busy 2-core box.
    for r in rows:
        assert r["ttft_p50_ms"]["b"] < 3 * r["ttft_p50_ms"]["a"] + 10
    assert "compare: A = " in stdout.getvalue()
