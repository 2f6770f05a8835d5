"""The knee controller, driven by synthetic samples in virtual time."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from policies.base import Sample
from policies.knee import KneeLimit, KneeLimitConfig


@dataclass(frozen=True)
class Backend:
    """A synthetic engine: closed-loop response at concurrency c.

    Decode throughput c / (a + k·c) (13.5 ms per step alone, +0.54 ms per running
    sequence: ~1,040 tok/s at 32, as the seed figures), flat past ``plateau``
    running sequences; p95 TTFT 0.06 s + 0.23 s·(c/knee)^4, i.e. 0.29 s at
    ``knee`` and crossing the 0.5 s SLO at ~1.18·knee.
    """

    knee: float = 32.0
    plateau: int = 58
    step_s: float = 0.0135
    per_seq_s: float = 0.00054

    def tput(self, c: int) -> float:
        running = min(c, self.plateau)
        return running / (self.step_s + self.per_seq_s * running)

    def ttft(self, c: int) -> float:
        return 0.06 + 0.23 * (c / self.knee) ** 4

    def itl(self, c: int) -> float:
        return 1.3 * (self.step_s + self.per_seq_s * min(c, self.plateau))

    @property
    def slo_limit(self) -> float:
        """The concurrency at which p95 TTFT reaches 0.5 s."""
        return self.knee * float((0.44 / 0.23) ** 0.25)

    @property
    def knee_limit(self) -> float:
        """Where rule 4 (fraction 0.4) or the SLO stops, whichever comes first.

        For this throughput curve, gain per permit over average per permit between
        any two levels R < L is exactly step_s / (step_s + per_seq_s * L).
        """
        marginal = self.step_s * (1 / 0.4 - 1) / self.per_seq_s
        return min(self.slo_limit, marginal)


def drive(
    ctl: KneeLimit,
    phases: list[tuple[int, Backend]],
    *,
    clients: int = 128,
    window: int = 5,
    noise: float = 0.05,
    seed: int = 7,
    engine_waiting: Callable[[Backend, int], int | None] = lambda b, c: None,
) -> list[int]:
    """One sample per virtual second; the window lags the limit by ``window`` seconds."""
    rng = random.Random(seed)
    history: list[int] = []
    limits: list[int] = []
    now = 0
    for seconds, backend in phases:
        for _ in range(seconds):
            c = min(ctl.limit, clients)
            history.append(c)
            recent = history[-window:]
            worst = max(recent)  # a window's p95 is dominated by its busiest moment
            jitter = 1 + rng.uniform(-noise, noise)
            tput = sum(backend.tput(x) for x in recent) / len(recent)
            ctl.update(
                Sample(
                    now=float(now),
                    ttft_p95=backend.ttft(worst) * jitter,
                    itl_p95=backend.itl(worst) * jitter,
                    output_tokens_per_s=tput * (1 + rng.uniform(-0.02, 0.02)),
                    in_flight=c,
                    completed=c // 4,
                    engine_waiting=engine_waiting(backend, c),
                    demand=clients - c,
                )
            )
            limits.append(ctl.limit)
            now += 1
    return limits


def sample(now: float, **overrides: float | int | None) -> Sample:
    fields: dict[str, float | int | None] = dict(
        ttft_p95=0.1,
        itl_p95=0.02,
        output_tokens_per_s=1000.0,
        in_flight=40,
        completed=10,
        engine_waiting=None,
        demand=10,
    )
    fields.update(overrides)
    return Sample(now=now, **fields)  # type: ignore[arg-type]


# Unit tests of single rules feed a constant throughput, so they switch rule 4 off
# (marginal_fraction=0.0), and raise limits at once (INSTANT) unless testing the ramp.
INSTANT = 1e6


def knee(initial: int, **knobs: float) -> KneeLimit:
    """A fresh controller, already ramped up to ``initial`` unless ramp_per_s is given."""
    knobs.setdefault("ramp_per_s", INSTANT)
    return KneeLimit(KneeLimitConfig(initial=initial, **knobs))  # type: ignore[arg-type]


def settled(limits: list[int], after: int) -> tuple[int, float]:
    """Median of the tail and its widest relative deviation."""
    tail = limits[after:]
    mid = statistics.median(tail)
    return int(mid), max(abs(x - mid) / mid for x in tail)


@pytest.mark.parametrize("initial", [4, 128])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_converges_to_the_knee_from_both_sides(initial: int, seed: int) -> None:
    backend = Backend()
    limits = drive(KneeLimit(KneeLimitConfig(initial=initial)), [(400, backend)], seed=seed)
    mid, swing = settled(limits, after=120)
    assert 24 <= min(limits[120:]) and max(limits[120:]) <= 48
    assert mid <= backend.knee_limit  # the SLO holds, the last permits were worth it
    assert swing <= 0.25


def test_settles_on_the_throughput_knee_when_latency_never_objects() -> None:
    # Throughput stops at 32 running sequences, TTFT stays far below its SLO.
    flat = Backend(knee=1000.0, plateau=32)
    with_marginal = drive(KneeLimit(KneeLimitConfig(initial=4)), [(300, flat)])
    no_rule_4 = KneeLimitConfig(initial=4, marginal_fraction=0.0)
    without = drive(KneeLimit(no_rule_4), [(300, flat)])
    # Levels are compared marginal_span (25 %) apart, so the stop lands within that span.
    assert 32 <= statistics.median(with_marginal[100:]) <= 32 / 0.75
    assert min(without[100:]) > 48  # only noise (a negative gain) stops it, far higher


SLOWER = Backend(knee=20, plateau=40)  # e.g. an L4 instead of an L40S
FASTER = Backend(knee=44, plateau=80, step_s=0.0108, per_seq_s=0.000324)  # e.g. FP8


@pytest.mark.parametrize("after", [SLOWER, FASTER])
def test_follows_a_backend_that_changes_under_load(after: Backend) -> None:
    limits = drive(KneeLimit(KneeLimitConfig(initial=4)), [(200, Backend()), (300, after)])
    # Within 120 s of the change (t = 200) the limit sits near the new knee.
    target = after.knee_limit
    mid, swing = settled(limits, after=320)
    assert abs(mid - target) / target <= 0.2
    assert swing <= 0.25


def test_backs_off_multiplicatively_scaled_by_severity() -> None:
    ctl = knee(40)
    # pressure 1.2 -> factor min(backoff 0.9, 1/1.2) = 0.833 -> floor(33.3)
    assert ctl.update(sample(0, ttft_p95=0.6)) == 33
    assert ctl.ceiling == 40
    # Within settle_s the window still holds the old breach: no second cut.
    assert ctl.update(sample(1, ttft_p95=0.6, in_flight=33)) == 33
    # Severe breach: the cut is capped at one half.
    assert ctl.update(sample(5, ttft_p95=3.0, in_flight=33)) == 16
    # A mild breach still costs at least one permit.
    mild = knee(5)
    assert mild.update(sample(0, ttft_p95=0.51, in_flight=5)) == 4


def test_itl_breach_backs_off_too() -> None:
    ctl = knee(40, itl_p95_slo=0.05)
    assert ctl.update(sample(0, itl_p95=0.1)) == 20


def test_holds_when_the_backend_is_not_the_bottleneck() -> None:
    ctl = knee(40)
    for t in range(0, 200, 5):
        assert ctl.update(sample(t, in_flight=12, demand=3)) == 40
    # Saturated but nobody waiting: no reason to probe either.
    for t in range(200, 400, 5):
        assert ctl.update(sample(t, in_flight=40, demand=0)) == 40


def test_probes_up_in_proportion_to_headroom_after_settling() -> None:
    ctl = knee(10, marginal_fraction=0.0, ramp_per_s=INSTANT)
    # pressure 0.2 -> headroom 0.8 -> step round(10 * 0.5 * 0.8) = 4
    assert ctl.update(sample(0, in_flight=10)) == 14
    assert ctl.update(sample(4.9, in_flight=14)) == 14  # still settling
    assert ctl.update(sample(5, in_flight=14, ttft_p95=0.46)) == 14  # headroom 0.08 < 0.1
    assert ctl.update(sample(10, in_flight=14, ttft_p95=0.3)) == 17  # 14 * 0.5 * 0.4 = 2.8


def test_no_latency_evidence_probes_moderately() -> None:
    ctl = knee(4, marginal_fraction=0.0)
    blind = sample(0, in_flight=4, ttft_p95=None, itl_p95=None)
    assert ctl.update(blind) == 5  # headroom taken as 0.5: 4 * 0.5 * 0.5 = 1


def test_engine_queueing_means_the_limit_is_too_high() -> None:
    ctl = knee(40)
    # The engine runs 34 and queues 6: go to what it runs.
    assert ctl.update(sample(0, in_flight=40, engine_waiting=6)) == 34
    assert ctl.ceiling == 40
    # A huge engine queue still cuts at most by half per settle period.
    assert ctl.update(sample(5, in_flight=34, engine_waiting=30)) == 17
    tolerant = knee(40, engine_waiting_tolerance=2, marginal_fraction=0.0)
    assert tolerant.update(sample(0, in_flight=40, engine_waiting=2)) > 40


def test_engine_waiting_keeps_the_limit_below_the_engine_capacity() -> None:
    # The engine runs at most 36 sequences; TTFT alone would tolerate ~37.6.
    backend = Backend(plateau=36)
    limits = drive(
        KneeLimit(KneeLimitConfig(initial=128)),
        [(300, backend)],
        engine_waiting=lambda b, c: max(0, c - b.plateau),
    )
    tail = limits[60:]
    # Only the periodic re-probe (1, then 2 permits, once per ceiling TTL) pokes above.
    assert max(tail) <= 38
    assert sum(x > 36 for x in tail) <= 0.05 * len(tail)
    assert min(tail) >= 30


def test_ceiling_blocks_reprobing_until_it_expires() -> None:
    ctl = knee(40, ceiling_ttl_s=60, marginal_fraction=0.0)
    assert ctl.update(sample(0, ttft_p95=0.6)) == 33
    t = 5.0
    while t < 60:
        ctl.update(sample(t, in_flight=ctl.limit, ttft_p95=0.1))
        assert ctl.limit <= 39
        t += 5
    assert ctl.update(sample(60, in_flight=ctl.limit, ttft_p95=0.1)) > 39


def test_stays_within_bounds() -> None:
    cfg = KneeLimitConfig(initial=10, min=8, max=12, marginal_fraction=0.0)
    ctl = KneeLimit(cfg)
    for t in range(0, 100, 5):
        assert 8 <= ctl.update(sample(t, in_flight=ctl.limit, ttft_p95=0.01)) <= 12
    assert ctl.limit == 12
    for t in range(100, 200, 5):
        assert 8 <= ctl.update(sample(t, in_flight=ctl.limit, ttft_p95=5.0)) <= 12
    assert ctl.limit == 8


def test_a_carried_limit_resumes_without_slow_start() -> None:
    fresh = knee(30, marginal_fraction=0.0)
    resumed = KneeLimit(
        KneeLimitConfig(initial=8, marginal_fraction=0.0, ramp_per_s=INSTANT), start=30
    )
    assert resumed.limit == 30
    s = sample(0, in_flight=30, ttft_p95=0.25)  # headroom 0.5
    assert fresh.update(s) == 38  # 30 * 0.5 * 0.5 = 7.5 -> 8
    assert resumed.update(s) == 31  # re-probing starts with one permit ...
    assert resumed.update(sample(5, in_flight=31, ttft_p95=0.25)) == 33  # ... then doubles


def test_a_raise_is_granted_gradually() -> None:
    # N permits at once would be N prefills queued behind each other.
    ctl = KneeLimit(KneeLimitConfig(initial=24, marginal_fraction=0.0, ramp_per_s=4.0))
    assert ctl.limit == 4  # a fresh start ramps up to `initial` too
    assert ctl.update(sample(0, in_flight=4, ttft_p95=0.0)) == 8  # one second assumed
    assert ctl.update(sample(1, in_flight=8, ttft_p95=0.0)) == 12
    assert ctl.update(sample(1.5, in_flight=12, ttft_p95=0.0)) == 14
    assert ctl.update(sample(4, in_flight=14, ttft_p95=0.0)) == 24
    assert ctl.update(sample(8.9, in_flight=24, ttft_p95=0.0)) == 24  # settling from t=4
    # A probe: pressure 0.2 (ITL) -> target 24 + round(24 * 0.5 * 0.8) = 34, paced.
    assert ctl.update(sample(9, in_flight=24, ttft_p95=0.0)) == 25  # 0.1 s since last
    assert ctl.update(sample(10, in_flight=25, ttft_p95=0.0)) == 29
    assert ctl.update(sample(10.5, in_flight=29, ttft_p95=0.0)) == 31
    # A breach still cuts at once, judged on what was in flight.
    assert ctl.update(sample(11, in_flight=31, ttft_p95=1.0)) == 15


def test_a_carried_limit_is_not_ramped() -> None:
    ctl = KneeLimit(KneeLimitConfig(initial=4, ramp_per_s=4.0), start=64)
    assert ctl.limit == 64  # its load is already there
