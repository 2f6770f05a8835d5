"""Percentiles, per-point summaries, goodput and SLO parsing."""

from __future__ import annotations

import pytest

from gateway.bench.slo import SloError, SloTerm, parse_slo
from gateway.bench.stats import RequestRecord, percentile, request_meets, summarize


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)  # rank 3.6
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_parse_slo_reads_any_metric_percentile_and_unit() -> None:
    slo = parse_slo("ttft_p95_ms=500, itl_p99.9_ms=50,e2e_p50_s=20,tpot_p90_ms=40")
    assert slo.terms == (
        SloTerm("ttft", 95.0, 0.5),
        SloTerm("itl", 99.9, 0.05),
        SloTerm("e2e", 50.0, 20.0),
        SloTerm("tpot", 90.0, 0.04),
    )
    assert str(parse_slo("ttft_p95_ms=500")) == "ttft_p95_ms=500"
    assert slo.percentiles("itl") == (99.9,)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty SLO"),
        ("ttft=500", "expected METRIC_pNN_UNIT=VALUE"),
        ("ttft_p95_ms", "expected METRIC_pNN_UNIT=VALUE"),
        ("queue_p95_ms=5", "bad SLO metric 'queue'"),
        ("ttft_p0_ms=5", "percentile"),
        ("ttft_p95_ms=fast", "not a number"),
        ("ttft_p95_ms=-1", "must be positive"),
        ("ttft_p95_min=1", "expected METRIC_pNN_UNIT=VALUE"),
        ("ttft_p95_ms=1,ttft_p95_s=2", "given twice"),
    ],
)
def test_parse_slo_errors_name_the_bad_term(text: str, fragment: str) -> None:
    with pytest.raises(SloError, match=fragment):
        parse_slo(text)


def _ok(ttft: float, itls: list[float], output: int = 0, prompt: int = 100) -> RequestRecord:
    output = output or len(itls) + 1
    return RequestRecord(
        prompt, output, ttft=ttft, e2e=ttft + sum(itls), itls=itls, prompt_class=prompt
    )


def test_summary_figures_and_tpot() -> None:
    records = [_ok(0.1 * (i + 1), [0.01] * 9) for i in range(10)]  # TTFT 0.1 .. 1.0 s
    records.append(RequestRecord(100, 0, error="HTTP 500: boom"))
    s = summarize(
        records,
        workload="100",
        load_kind="concurrency",
        load=4,
        window_s=2.0,
        window_output_tokens=150.0,
    )
    assert (s.requests, s.errors) == (10, 1)
    assert s.error_samples == ("HTTP 500: boom",)
    assert s.output_tok_s == 75.0  # window tokens over the window, not per request
    assert s.request_s == 5.0
    assert s.total_tok_s == 75.0 + 10 * 100 / 2.0
    assert s.ttft is not None and s.ttft.at(50.0) == pytest.approx(0.55)
    assert s.ttft.at(95.0) == pytest.approx(0.955)
    assert s.itl is not None and s.itl.at(99.0) == pytest.approx(0.01)
    assert s.tpot is not None and s.tpot.at(50.0) == pytest.approx(0.01)  # 9 gaps / 9
    assert s.ttft_by_prompt[100].at(95.0) == pytest.approx(0.955)
    assert s.slo_ok is None and s.goodput_req_s is None


def test_goodput_counts_only_requests_meeting_every_term() -> None:
    slo = parse_slo("ttft_p95_ms=500,itl_p50_ms=20")
    fast = _ok(0.2, [0.01] * 4)
    slow_start = _ok(0.8, [0.01] * 4)
    stalling = _ok(0.2, [0.05] * 4)
    one_stall = _ok(0.2, [0.01, 0.01, 0.01, 0.5])  # median gap still fine
    assert request_meets(slo, fast) and request_meets(slo, one_stall)
    assert not request_meets(slo, slow_start) and not request_meets(slo, stalling)
    s = summarize(
        [fast, slow_start, stalling, one_stall],
        workload="w",
        load_kind="concurrency",
        load=4,
        window_s=2.0,
        window_output_tokens=20,
        slo=slo,
    )
    assert s.goodput_req_s == pytest.approx(2 / 2.0)
    assert s.goodput_tok_s == pytest.approx(10 / 2.0)
    # The point as a whole: p95 TTFT ~0.71 s > 0.5 s fails the SLO.
    assert s.slo_values["ttft_p95"] == pytest.approx(0.71)
    assert s.slo_ok is False


def test_slo_holds_when_every_percentile_is_within_its_limit() -> None:
    slo = parse_slo("ttft_p95_ms=500,e2e_p99_s=2")
    s = summarize(
        [_ok(0.1, [0.01] * 3) for _ in range(20)],
        workload="w",
        load_kind="rate",
        load=1,
        window_s=10,
        window_output_tokens=80,
        slo=slo,
    )
    assert s.slo_ok is True
    assert s.slo_values == {"ttft_p95": pytest.approx(0.1), "e2e_p99": pytest.approx(0.13)}


def test_point_with_only_errors_fails_the_slo_and_has_no_latency() -> None:
    s = summarize(
        [RequestRecord(10, 0, error="x")],
        workload="w",
        load_kind="rate",
        load=1,
        window_s=1,
        window_output_tokens=0,
        slo=parse_slo("ttft_p95_ms=1"),
    )
    assert s.slo_ok is False and s.ttft is None and s.requests == 0


def test_a_point_with_failed_requests_fails_the_slo_however_fast_the_rest() -> None:
    # Half the requests answered 400: the SLO read "ok" on the fast half, and a knee and a
    # policy came out of a target that was failing.
    fast = [_ok(0.1, [0.01] * 3) for _ in range(20)]
    s = summarize(
        fast + [RequestRecord(10, 0, error="400 bad request")] * 20,
        workload="w",
        load_kind="rate",
        load=1,
        window_s=10,
        window_output_tokens=80,
        slo=parse_slo("ttft_p95_ms=500"),
    )
    assert s.errors == 20
    assert s.slo_ok is False
