"""Knee detection on synthetic curves whose knee is known."""

from __future__ import annotations

from gateway.bench.knee import CurvePoint, find_knee, marginal_knee, slo_knee


def _curve(points: dict[float, float], ok_up_to: float | None = None) -> list[CurvePoint]:
    return [
        CurvePoint(load, tps, None if ok_up_to is None else load <= ok_up_to)
        for load, tps in points.items()
    ]


def saturating(c: float) -> float:
    """Linear at 74 tok/s per request up to 32, then +5.4 tok/s per request."""
    return 74 * c if c <= 32 else 74 * 32 + 5.4 * (c - 32)


FINE = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96)


def test_marginal_knee_on_a_known_curve() -> None:
    knee = find_knee(_curve({c: saturating(c) for c in FINE}), "concurrency")
    assert knee.load == 32 and knee.basis == "marginal"
    assert not knee.too_coarse and knee.proposed == ()
    assert "from 32 to 40" in knee.marginal.reason and "7%" in knee.marginal.reason


def test_threshold_fraction_moves_the_knee() -> None:
    curve = _curve({1: 100, 2: 200, 4: 380, 8: 620, 16: 900, 32: 1100})
    # Marginals: 100, 100, 90, 60, 35, 12.5 tok/s per unit.
    assert marginal_knee(curve, "concurrency", fraction=0.10).load is None
    assert marginal_knee(curve, "concurrency", fraction=0.20).load == 16
    assert marginal_knee(curve, "concurrency", fraction=0.50).load == 8


def test_curve_without_a_knee_says_so_and_proposes_larger_loads() -> None:
    knee = find_knee(_curve({c: 70.0 * c for c in FINE}), "concurrency")
    assert knee.load is None and knee.basis == "none"
    assert knee.marginal.load is None
    assert "no knee up to 96" in knee.marginal.reason and "extend the sweep" in knee.marginal.reason
    assert knee.too_coarse and knee.proposed == (144.0, 192.0)


def test_too_coarse_sweep_is_flagged_with_points_inside_the_bracket() -> None:
    knee = find_knee(_curve({1: 74, 8: 580, 64: 620}), "concurrency")
    assert knee.load == 8 and knee.too_coarse
    assert knee.proposed == (13.0, 23.0, 38.0)
    assert all(8 < x < 64 for x in knee.proposed)


def test_knee_at_the_first_point_proposes_smaller_loads() -> None:
    knee = find_knee(_curve({8: 600, 16: 620, 32: 630}), "concurrency")
    assert knee.load == 8 and knee.too_coarse
    assert 1.0 in knee.proposed and all(x < 16 for x in knee.proposed)


def test_slo_knee_is_the_largest_load_holding_with_all_smaller_loads() -> None:
    points = [
        CurvePoint(c, saturating(c), ok, "ttft_p95 720 ms > 500 ms" if not ok else "")
        for c, ok in ((1, True), (8, True), (16, True), (24, True), (32, False), (48, True))
    ]  # 48 "holds" by noise: must not count
    finding = slo_knee(points, "concurrency")
    assert finding.load == 24 and not finding.coarse
    assert "fails at 32 (ttft_p95 720 ms > 500 ms)" in finding.reason


def test_recommended_knee_is_the_smaller_of_slo_and_marginal() -> None:
    curve = _curve({c: saturating(c) for c in FINE}, ok_up_to=24)
    knee = find_knee(curve, "concurrency")
    assert (knee.load, knee.basis) == (24, "slo")
    assert knee.marginal.load == 32
    tie = find_knee(_curve({c: saturating(c) for c in FINE}, ok_up_to=32), "concurrency")
    assert (tie.load, tie.basis) == (32, "slo")
    loose = find_knee(_curve({c: saturating(c) for c in FINE}, ok_up_to=48), "concurrency")
    assert (loose.load, loose.basis) == (32, "marginal")


def test_slo_failing_everywhere_leaves_no_operating_point() -> None:
    knee = find_knee(_curve({4: 280, 8: 560, 16: 1000}, ok_up_to=0), "concurrency")
    assert knee.load is None and knee.basis == "none"
    assert knee.slo is not None and "fails already at the smallest load 4" in knee.slo.reason
    assert knee.slo.proposed == (1.0, 2.0, 3.0)


def test_slo_holding_everywhere_asks_for_a_wider_sweep() -> None:
    finding = slo_knee(_curve({1: 74, 2: 148}, ok_up_to=1000), "concurrency")
    assert finding.load == 2 and finding.coarse and finding.proposed == (3.0, 4.0)


def test_coarse_slo_bracket_on_an_open_loop_proposes_rates() -> None:
    finding = slo_knee(_curve({0.5: 500, 4: 3000}, ok_up_to=0.5), "rate")
    assert finding.load == 0.5 and finding.coarse
    assert finding.proposed and all(0.5 < x < 4 for x in finding.proposed)


def test_a_single_point_cannot_place_a_knee() -> None:
    knee = find_knee([CurvePoint(8, 600)], "concurrency")
    assert knee.load is None and knee.too_coarse
