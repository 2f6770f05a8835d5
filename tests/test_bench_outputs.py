"""The table, JSON, CSV, comparison, policy fragment and plot of a known sweep."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import yaml

from gateway.bench.compare import comparison_json, render_comparison
from gateway.bench.export import SCHEMA, result_csv, result_json
from gateway.bench.knee import find_knee
from gateway.bench.policy import PolicyError, policy_fragment, policy_yaml
from gateway.bench.report import render
from gateway.bench.slo import parse_slo
from gateway.bench.stats import PointSummary, RequestRecord, summarize
from gateway.bench.sweep import Series, SweepPlan, SweepResult, curve_of
from gateway.settings import build_settings

SLO = parse_slo("ttft_p95_ms=500")
# load -> (output tok/s, TTFT s): linear to 32, flat after; TTFT explodes past 48.
CURVE = {
    1: (74, 0.05),
    8: (590, 0.1),
    16: (1180, 0.2),
    32: (2300, 0.3),
    48: (2350, 0.45),
    64: (2380, 2.1),
    96: (2390, 6.0),
}


def _point(
    load: float, tps: float, ttft: float, workload: str = "1024", scale: float = 1.0
) -> PointSummary:
    records = [
        RequestRecord(
            1024,
            8,
            ttft=ttft * scale,
            e2e=ttft * scale + 0.07,
            itls=[0.01] * 7,
            prompt_class=int(workload),
        )
        for _ in range(20)
    ]
    return summarize(
        records,
        workload=workload,
        load_kind="concurrency",
        load=load,
        window_s=10,
        window_output_tokens=tps * scale * 10,
        slo=SLO,
    )


def _series(target: str, workload: str = "1024", scale: float = 1.0) -> Series:
    points = tuple(_point(c, tps, t, workload, scale) for c, (tps, t) in CURVE.items())
    return Series(
        target, workload, "concurrency", points, find_knee(curve_of(points, SLO), "concurrency")
    )


PLAN = SweepPlan("concurrency", tuple(float(c) for c in CURVE), slo=SLO)


def test_json_has_one_object_per_point_and_the_knee() -> None:
    result = SweepResult(PLAN, (_series("A"),), {"A": ["note"]})
    doc = json.loads(json.dumps(result_json(result, {"url": "A"})))
    assert doc["schema"] == SCHEMA and doc["slo"] == "ttft_p95_ms=500"
    assert len(doc["points"]) == len(CURVE)
    p32 = next(p for p in doc["points"] if p["load"] == 32)
    assert p32["output_tok_s"] == 2300 and p32["ttft_ms"]["p95"] == pytest.approx(300)
    assert p32["slo_ok"] is True and p32["slo_values_ms"] == {"ttft_p95": pytest.approx(300)}
    assert p32["ttft_by_prompt_tokens_ms"]["1024"]["p95"] == pytest.approx(300)
    [knee] = doc["knees"]
    assert (knee["load"], knee["basis"]) == (32, "marginal")
    assert knee["slo"]["load"] == 48 and "fails at 64" in knee["slo"]["reason"]
    assert doc["knee"] == {"target": "A", "load_kind": "concurrency", "load": 32}


def test_csv_has_a_header_and_a_row_per_point() -> None:
    rows = list(csv.DictReader(io.StringIO(result_csv(SweepResult(PLAN, (_series("A"),))))))
    assert len(rows) == len(CURVE)
    assert float(rows[0]["ttft_p95_ms"]) == pytest.approx(50)
    assert rows[-1]["slo_ok"] == "False" and rows[0]["load"] == "1"


def test_table_states_the_knee_and_why() -> None:
    text = render(SweepResult(PLAN, (_series("A"),)), ["A: model m"])
    assert "note: A: model m" in text and "SLO: ttft_p95_ms=500" in text
    assert "knee at 32 (marginal)" in text
    assert "the SLO holds up to 48 concurrent and fails at 64 (ttft_p95 2100 ms > 500 ms)" in text
    row32 = next(line for line in text.splitlines() if line.split()[:1] == ["32"])
    assert "2,300" in row32 and " ok" in row32


def test_policy_fragment_starts_at_the_knee_and_caps_at_the_plateau() -> None:
    result = SweepResult(PLAN, (_series("A"), _series("A", "8192")))
    fragment = policy_fragment(result, "A")
    assert fragment == {
        "admission": {
            "limit": {"kind": "knee", "initial": 32, "min": 1, "max": 48, "ttft_p95_slo": 0.5}
        }
    }
    text = policy_yaml(result, "A")
    assert yaml.safe_load(text) == fragment and text.startswith("# kneecap bench against A")
    # It is a valid kneecap config as it stands.
    settings = build_settings(fragment)
    assert settings.admission.limit.initial == 32
    assert settings.admission.limit.ttft_p95_slo == 0.5


def test_policy_without_a_knee_is_an_error() -> None:
    linear = tuple(_point(c, 70 * c, 0.9) for c in (1, 2, 4))  # SLO fails everywhere
    series = Series(
        "A", "1024", "concurrency", linear, find_knee(curve_of(linear, SLO), "concurrency")
    )
    with pytest.raises(PolicyError, match="no knee to start from: the SLO fails already"):
        policy_fragment(SweepResult(PLAN, (series,)), "A")


def test_comparison_pairs_points_and_gives_ratios() -> None:
    result = SweepResult(PLAN, (_series("direct"), _series("gateway", scale=1.1)))
    rows = comparison_json(result, "direct", "gateway")
    assert len(rows) == len(CURVE)
    assert rows[0]["output_tok_s"]["ratio"] == pytest.approx(1.1)
    assert rows[0]["ttft_p95_ms"]["ratio"] == pytest.approx(1.1)
    text = render_comparison(result, "direct", "gateway")
    assert "A = direct  B = gateway" in text and "1.10x" in text


def test_plot_writes_a_png_with_a_prompt_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gateway.bench.plot import write_plot

    result = SweepResult(PLAN, (_series("A"), _series("A", "8192", scale=3.0)))
    path = tmp_path / "knee.png"
    write_plot(result, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    assert width > 1200  # two panels side by side


def test_progress_line_is_rewritten_live_and_summarised_per_point() -> None:
    from gateway.bench.phase import LoadPoint, Phase
    from gateway.bench.progress import ProgressDisplay

    stream = io.StringIO()
    wall = iter([0.0, 0.0, 0.1, 1.0, 1.0])
    progress = ProgressDisplay(stream, live=True, interval=0.25, wall=lambda: next(wall))
    point = LoadPoint("concurrency", 2, requests=4)
    phase = Phase(point)
    progress.begin(1, 3, "A", "1024", point)
    ticket = phase.issue(0.0)
    phase.delivered(50)
    phase.finish(ticket, RequestRecord(1024, 50, ttft=0.2, e2e=1.0), 1.0)
    progress.tick(phase, 1.0)  # shown
    progress.tick(phase, 1.0)  # throttled: 0.1 s later
    progress.tick(phase, 2.0)  # shown
    progress.end(_point(2, 100, 0.2))
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[1/3] A · 1024-token prompts · c=2 · 1/4 requests · p95 TTFT 200 ms · 50 tok/s" in text
    assert "SLO ok" in text.splitlines()[-1]


def test_no_policy_from_a_sweep_whose_target_fails_requests() -> None:
    # A target that went down mid-sweep answered thousands of errors a second; without an
    # SLO the marginal knee still placed a limit, and the policy was written, exit 0.
    plan = SweepPlan("concurrency", tuple(float(c) for c in CURVE))
    points = []
    for c, (tps, ttft) in CURVE.items():
        records = [RequestRecord(1024, 8, ttft=ttft, e2e=ttft + 0.07, itls=[0.01] * 7)] * 20
        if c == 16:
            records += [RequestRecord(1024, 0, error="connection refused")] * 5
        points.append(
            summarize(
                records,
                workload="1024",
                load_kind="concurrency",
                load=c,
                window_s=10,
                window_output_tokens=tps * 10,
            )
        )
    series = Series(
        "A", "1024", "concurrency", tuple(points), find_knee(curve_of(points, None), "concurrency")
    )
    assert series.knee.load is not None and series.knee.load >= 16
    with pytest.raises(PolicyError, match="5 of 25 requests failed at load 16"):
        policy_fragment(SweepResult(plan, (series,)), "A")
