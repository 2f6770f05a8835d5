"""The knee controller, driven by synthetic samples in virtual time."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import pytest

from policies.base import Sample
from policies.knee import KneeLimit, KneeLimitConfig, Solo
from policies.registry import reconfigure


@dataclass(frozen=True)
class Backend:
    """A synthetic decode-bound engine.

    A stream's time per token is ``a + b * running`` (13.5 ms alone, +0.68 ms per
    running sequence: ~900 tok/s at 32); the engine runs at most ``capacity``
    sequences and queues the rest (engine_waiting). The knee is where
    a + b * c = a / marginal_fraction, c = (1 / marginal_fraction - 1) * a / b.
    """

    a: float = 0.0135
    b: float = 0.00068
    capacity: int = 58

    def running(self, c: int) -> int:
        return min(c, self.capacity)

    def tput(self, c: int) -> float:
        r = self.running(c)
        return r / (self.a + self.b * r) if r else 0.0

    @property
    def knee(self) -> float:
        fraction = KneeLimitConfig().marginal_fraction
        return (1 / fraction - 1) * self.a / self.b


def drive(
    ctl: KneeLimit,
    phases: list[tuple[int, Backend]],
    *,
    clients: int = 128,
    noise: float = 0.03,
    seed: int = 7,
    start: float = 0.0,
    cadence_jitter: float = 0.0,
) -> list[int]:
    """One sample per virtual second (+-cadence_jitter); in flight follows the limit
    at once (a queue)."""
    rng = random.Random(seed)
    limits: list[int] = []
    now = start
    for seconds, backend in phases:
        for _ in range(seconds):
            c = min(ctl.limit, clients)
            waiting = c - backend.running(c)
            ctl.update(
                Sample(
                    now=now,
                    ttft_p95=None,  # long requests: too few first tokens per window
                    itl_p95=None,
                    output_tokens_per_s=backend.tput(c) * (1 + rng.uniform(-noise, noise)),
                    in_flight=c,
                    completed=0,
                    engine_waiting=waiting,
                    demand=clients - c,
                )
            )
            limits.append(ctl.limit)
            now += 1 + rng.uniform(-cadence_jitter, cadence_jitter)
    return limits


def sample(now: float, **overrides: float | int | None) -> Sample:
    fields: dict[str, float | int | None] = dict(
        ttft_p95=0.1,
        itl_p95=0.03,
        output_tokens_per_s=1000.0,
        in_flight=40,
        completed=10,
        engine_waiting=0,
        demand=10,
    )
    fields.update(overrides)
    return Sample(now=now, **fields)  # type: ignore[arg-type]


def carried(limit: int, solo: float | None = None, **knobs: float) -> KneeLimit:
    """A controller resuming at ``limit`` (as after a reload): no ramp, no solo phase.

    ``solo``: what its predecessor measured (seconds per token with nothing else running).
    """
    learned = None if solo is None else (solo, 0.0)
    return KneeLimit(KneeLimitConfig(**knobs), start=limit, solo=learned)  # type: ignore[arg-type]


def settled(limits: list[int], after: int) -> tuple[float, float]:
    """Median of the tail and its widest relative deviation."""
    tail = limits[after:]
    mid = statistics.median(tail)
    return mid, max(abs(x - mid) / mid for x in tail)


@pytest.mark.parametrize("initial", [4, 128])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_converges_to_the_knee_from_both_sides(initial: int, seed: int) -> None:
    backend = Backend()
    limits = drive(KneeLimit(KneeLimitConfig(initial=initial)), [(400, backend)], seed=seed)
    mid, swing = settled(limits, after=120)
    assert 24 <= min(limits[120:]) and max(limits[120:]) <= 48
    assert abs(mid - backend.knee) / backend.knee <= 0.15
    assert swing <= 0.25


def test_a_jittery_sampling_cadence_changes_nothing() -> None:
    # A busy gateway's control ticks come late and early; windows still count.
    backend = Backend()
    limits = drive(KneeLimit(KneeLimitConfig(initial=128)), [(400, backend)], cadence_jitter=0.3)
    mid, swing = settled(limits, after=120)
    assert abs(mid - backend.knee) / backend.knee <= 0.15
    assert swing <= 0.25


def test_the_knee_estimate_is_where_a_stream_decodes_at_the_fraction_of_solo() -> None:
    ctl = KneeLimit(KneeLimitConfig(initial=4, ramp_per_s=4))
    # The first level (4) is held until a window's worth of samples measured solo.
    for t in range(7):
        ctl.update(sample(t, in_flight=4, output_tokens_per_s=4 / 0.015))
    assert ctl.solo == pytest.approx(0.015)
    ctl = carried(40, solo=0.015, knee_smoothing_s=0, marginal_fraction=0.4)
    for t in range(7):  # 40 streams at 30 ms a token: b = 15 ms / 40
        ctl.update(sample(t, in_flight=40, output_tokens_per_s=40 / 0.030))
    # k = a / b * (1 / 0.4 - 1) = 0.015 / (0.015 / 40) * 1.5 = 60
    assert ctl.knee == pytest.approx(60.0)


def test_a_fresh_start_holds_its_first_level_until_solo_is_measured() -> None:
    ctl = KneeLimit(KneeLimitConfig(initial=64, ramp_per_s=4))
    assert ctl.limit == 4  # solo_level
    for t in range(5):
        assert ctl.update(sample(t, in_flight=4, output_tokens_per_s=280.0)) == 4
    assert ctl.solo is None  # not a window's worth of samples yet
    assert ctl.update(sample(5, in_flight=4, output_tokens_per_s=280.0)) == 8  # ramping
    assert ctl.solo == pytest.approx(4 / 280)
    assert ctl.update(sample(6, in_flight=8, output_tokens_per_s=500.0)) == 12
    # The ramp is a rate: twice as fast at twice the sampling rate of twice ramp_per_s.
    fast = KneeLimit(KneeLimitConfig(initial=64, ramp_per_s=8))
    assert fast.limit == 4
    for t in range(11):
        fast.update(sample(t / 2, in_flight=4, output_tokens_per_s=280.0))
    assert fast.limit == 8
    assert fast.update(sample(5.5, in_flight=8, output_tokens_per_s=500.0)) == 12


def test_the_ramp_to_a_high_initial_limit_stops_where_the_window_says_the_knee_is() -> None:
    backend = Backend(capacity=200)  # no queueing: only the estimate can stop it
    limits = drive(KneeLimit(KneeLimitConfig(initial=128)), [(60, backend)])
    assert limits[6] > 4  # solo measured at the first level, then the ramp
    assert max(limits) < 1.6 * backend.knee  # well short of 128


def test_engine_queueing_that_persists_cuts_below_what_the_engine_runs() -> None:
    ctl = carried(60)
    # A burst of admissions queues for a few steps: no verdict on the backend.
    for t in range(4):
        assert ctl.update(sample(t, in_flight=60, engine_waiting=20)) == 60
    assert ctl.update(sample(4, in_flight=60, engine_waiting=0)) == 60
    # A full KV cache queues for good: the engine holds 60 - 10 = 50.
    for t in range(5, 10):
        assert ctl.update(sample(t, in_flight=60, engine_waiting=10)) == 60
    assert ctl.update(sample(10, in_flight=60, engine_waiting=10)) == 40  # 0.8 * 50
    assert ctl.ceiling == 50
    # Requests admitted under the old limit drain slowly; judged on what they show.
    assert ctl.update(sample(15, in_flight=58, engine_waiting=8)) == 40


def test_a_slo_breach_backs_off_by_its_severity_and_at_most_by_half() -> None:
    ctl = carried(40)
    # pressure 1.2: min(0.8 * 40, 40 / 1.2) = 32
    assert ctl.update(sample(0, ttft_p95=0.6)) == 32
    assert ctl.ceiling == 40
    # Within settle_s the window still holds the old breach: no second cut.
    assert ctl.update(sample(1, ttft_p95=0.6, in_flight=32)) == 32
    # Severe breach: the cut is capped at one half.
    assert ctl.update(sample(5, ttft_p95=3.0, in_flight=32)) == 16
    itl = carried(40, itl_p95_slo=0.05)
    assert itl.update(sample(0, itl_p95=0.1)) == 20


def test_holds_when_the_backend_is_not_the_bottleneck() -> None:
    ctl = carried(40, solo=0.015)
    fast = 12 / 0.016  # the streams decode almost at solo speed: the knee is far above
    for t in range(0, 200, 5):
        assert ctl.update(sample(t, in_flight=12, output_tokens_per_s=fast)) == 40
    # Saturated but nobody waiting: no reason to raise either.
    for t in range(200, 400, 5):
        assert ctl.update(sample(t, in_flight=40, demand=0)) == 40


def test_the_ceiling_caps_the_estimate_until_it_expires() -> None:
    ctl = carried(40, solo=0.015, ceiling_ttl_s=60)
    assert ctl.update(sample(0, ttft_p95=0.6)) == 32  # ceiling 40
    fast = {"output_tokens_per_s": 32 / 0.016, "ttft_p95": 0.1}  # the knee looks far away
    t = 1
    while t < 60:
        ctl.update(sample(t, in_flight=ctl.limit, **fast))
        assert ctl.limit <= 32  # (1 - margin) * 40
        t += 1
    for t in range(60, 80):
        ctl.update(sample(t, in_flight=ctl.limit, **fast))
    assert ctl.limit > 40


def test_stays_within_bounds() -> None:
    cfg = KneeLimitConfig(initial=10, min=8, max=12)
    ctl = KneeLimit(cfg)
    assert ctl.limit == 8  # a fresh start begins at solo_level, clamped to min
    for t in range(0, 100):
        ctl.update(sample(t, in_flight=ctl.limit, output_tokens_per_s=ctl.limit / 0.014))
        assert 8 <= ctl.limit <= 12
    assert ctl.limit == 12
    for t in range(100, 200, 5):
        assert 8 <= ctl.update(sample(t, in_flight=ctl.limit, ttft_p95=5.0)) <= 12
    assert ctl.limit == 8


def test_a_carried_limit_is_kept_and_not_ramped() -> None:
    ctl = KneeLimit(KneeLimitConfig(initial=4, ramp_per_s=4.0), start=64)
    assert ctl.limit == 64  # its load is already there
    assert ctl.update(sample(0, in_flight=64)) == 64


def test_a_backend_that_gets_slower_is_followed() -> None:
    # An L4 instead of an L40S: every step ~2.7x slower and room for 20 sequences.
    slower = Backend(a=0.0365, b=0.00146, capacity=20)
    limits = drive(KneeLimit(KneeLimitConfig(initial=4)), [(200, Backend()), (500, slower)])
    assert 30 <= limits[199] <= 45
    after = limits[200 + 120 :]
    assert max(after) <= 20  # within 120 s the limit is below what the engine holds
    # The old solo speed makes the slower engine look past its knee until the limit
    # is low enough to measure solo again; then it recovers under the capacity.
    assert min(after) >= KneeLimitConfig().solo_level
    assert 10 <= statistics.median(limits[-100:]) <= 20


def test_a_backend_with_more_room_is_found_once_the_ceiling_expires() -> None:
    cramped = Backend(capacity=30)  # the engine queues before the knee (37) ...
    roomy = Backend(capacity=120)  # ... until it is given more KV cache
    cfg = KneeLimitConfig(initial=4, ceiling_ttl_s=60)
    limits = drive(KneeLimit(cfg), [(200, cramped), (300, roomy)])
    cramped_phase = limits[60:200]
    assert statistics.median(cramped_phase) == 24  # (1 - margin) * capacity
    # Above the capacity only while re-probing an expired ceiling, and briefly: the
    # ramp, then settle_s for the raise's own burst, then settle_s of queueing.
    runs, run = [], 0
    for x in cramped_phase:
        run = run + 1 if x > 30 else 0
        runs.append(run)
    assert max(runs) <= 15
    assert sum(x > 30 for x in cramped_phase) <= 0.2 * len(cramped_phase)
    mid, swing = settled(limits, after=350)
    assert abs(mid - roomy.knee) / roomy.knee <= 0.15
    assert swing <= 0.25


def test_an_objection_holds_the_most_the_engine_ran_over_settle_s() -> None:
    # Right after a burst of completions, preempted sequences count as waiting while
    # they are prefilled again: the engine's running count dips for a sample or two.
    ctl = carried(60)
    for t in range(5):
        assert ctl.update(sample(t, in_flight=60, engine_waiting=10)) == 60
    assert ctl.update(sample(5, in_flight=60, engine_waiting=40)) == 40  # 0.8 * 50, not 20
    assert ctl.ceiling == 50


def _thrash(ctl: KneeLimit, t: int, in_flight: int) -> None:
    """A slower backend's full KV cache: half the streams preempted, recomputing."""
    ctl.update(
        sample(t, in_flight=in_flight, engine_waiting=in_flight // 2, output_tokens_per_s=60.0)
    )


def test_a_backlog_above_the_limit_on_a_full_kv_cache_leaves_the_knee_estimate_alone() -> None:
    def measured(**knobs: float) -> KneeLimit:
        ctl = carried(40, solo=0.015, **knobs)
        for t in range(7):  # 40 streams at 30 ms a token: k = 40 * (1 / 0.35 - 1)
            ctl.update(sample(t, in_flight=40, output_tokens_per_s=40 / 0.030))
        assert ctl.knee == pytest.approx(74.3, rel=0.01)
        return ctl

    # Everything admitted before the cut stays in flight for minutes: what the engine
    # does with it says nothing about the knee.
    backlog = measured()
    t = 7
    while backlog.limit >= 40:
        _thrash(backlog, t, in_flight=40)
        t += 1
    knee = backlog.knee
    for later in range(t, t + 60):
        _thrash(backlog, later, in_flight=40)
        assert backlog.limit < 40
    assert backlog.knee == knee
    # The same windows at a load the limit admits (held there by its minimum) do move it.
    admitted = measured(initial=40, min=40, max=40)
    for t in range(7, 7 + 240):
        _thrash(admitted, t, in_flight=40)
        assert admitted.limit == 40
    assert admitted.knee is not None and knee is not None and admitted.knee < 0.5 * knee


def _steady(ctl: KneeLimit, start: int, seconds: int, y: float, c: int = 40) -> None:
    for t in range(start, start + seconds):
        ctl.update(sample(t, in_flight=c, output_tokens_per_s=c / y))


def test_streams_getting_faster_at_the_same_load_are_not_a_different_backend() -> None:
    # A closed loop's clients finish together and restart together: the young cohort
    # decodes faster than the old one did, at the same in-flight count.
    ctl = carried(40, solo=0.015)
    _steady(ctl, 0, 20, y=0.030)
    _steady(ctl, 20, 30, y=0.018)  # 0.6x: beyond drift_tolerance, in the other direction
    assert ctl.solo == pytest.approx(0.015)


def test_a_slower_backend_forgets_solo_and_holds_the_limit_until_solo_is_measured() -> None:
    ctl = carried(40, solo=0.015)
    _steady(ctl, 0, 20, y=0.030)
    t = 20
    while ctl.solo == pytest.approx(0.015):
        assert t < 40, "a twice slower backend at the same load went unnoticed"
        _steady(ctl, t, 1, y=0.060)
        t += 1
    # What the old solo says of the new backend is off by the ages of two populations:
    # forgotten, with the estimate judged against it.
    assert ctl.solo is None and ctl.knee is None and ctl.learned is None
    limit = ctl.limit
    _steady(ctl, t, 60, y=0.060)
    assert ctl.limit == limit  # held: no solo measured, nothing to move it by
    assert ctl.solo == pytest.approx(0.060)  # y bounds the new solo from above
    _steady(ctl, t + 60, 10, y=0.031, c=4)  # demand fell: the first level again
    assert ctl.learned == (pytest.approx(0.031), 4.0, None)


def test_a_slower_backend_seen_at_a_lower_load_is_recognised_and_the_limit_not_sunk() -> None:
    # An L40S at 41 in flight is redeployed as an L4 behind the gateway's token budget,
    # which admits 17 of the restarted streams; with 2,816-token outputs they hold
    # their permits for minutes, whatever the limit. Judged against the L40S's solo
    # the L4 looked far past its knee (k ~ 1-3) and the limit sank toward 1.
    l40s, l4 = Backend(), Backend(a=0.0365, b=0.00146, capacity=20)
    # solo measured at solo_level, as a fresh start does
    ctl = KneeLimit(KneeLimitConfig(), start=41, solo=(l40s.a + 4 * l40s.b, 4.0))
    _steady(ctl, 0, 30, y=41 / l40s.tput(41), c=41)
    limits = []
    for t in range(30, 230):
        ctl.update(sample(t, in_flight=17, output_tokens_per_s=l4.tput(17), ttft_p95=None))
        limits.append(ctl.limit)
    assert ctl.solo is not None and ctl.solo > 2 * l40s.a  # not the L40S's any more
    assert min(limits) >= 17  # never below what the budget holds in flight


def test_an_objection_at_a_level_the_limit_did_not_set_brings_it_down_to_that_level() -> None:
    # The token budget holds 17 in flight under a limit of 41: a breach there lowers
    # the limit to 17 (at most by half per settle_s), without the margin below it.
    ctl = carried(41)
    assert ctl.update(sample(0, in_flight=17, ttft_p95=2.6)) == 21  # at most by half
    assert ctl.update(sample(5, in_flight=17, ttft_p95=2.6)) == 17  # not 17 / 5.2
    for t in range(6, 60):
        assert ctl.update(sample(t, in_flight=17, ttft_p95=0.2)) == 17  # not 0.8 * 17
    # The next objection is at a level the limit holds: it goes below as usual.
    assert ctl.update(sample(60, in_flight=17, ttft_p95=0.6)) == 14  # 0.8 * 17


def _breach_of(ctl: KneeLimit, t: int, completed: int) -> int:
    return ctl.update(sample(t, in_flight=17, completed=completed, ttft_p95=0.66, itl_p95=0.3))


def test_clients_coming_back_together_breach_by_their_prefills_not_by_the_level() -> None:
    # 17 streams started together finish together: their clients come back at once and
    # 17 prefills breach the SLO whatever the limit (every static limit from 6 to 19
    # does after an L4 redeploy). No cut below what is in flight, no ceiling.
    ctl = carried(17)
    for t in range(10):
        ctl.update(sample(t, in_flight=17, completed=0, ttft_p95=None))
    for t in range(10, 20):
        assert _breach_of(ctl, t, completed=9 if t == 10 else 17) == 17
    assert ctl.ceiling is None
    # The same breach with completions as steady as short requests make them: the level's.
    steady = carried(17)
    for t in range(10):
        steady.update(sample(t, in_flight=17, completed=9, ttft_p95=None))
    assert _breach_of(steady, 10, completed=9) == 9  # 17 / pressure 2, up to 17 / 2
    assert steady.ceiling == 17


@dataclass(frozen=True)
class AgingCohort:
    """Streams whose KV grows as they decode: a step reads the weights (``a``) plus
    every token held, so y = a + per_kv * usage, usage the share of the cache held."""

    a: float = 0.0128
    per_kv: float = 0.040  # s per token for a full cache
    prompt: int = 1024
    cache_tokens: int = 200_000

    def usage(self, c: int, age: int) -> float:
        return c * (self.prompt + age) / self.cache_tokens

    def y(self, c: int, age: int) -> float:
        return self.a + self.per_kv * self.usage(c, age)

    def knee(self, c: int, age: int) -> float:
        """Where y = a / marginal_fraction, every stream at this age."""
        per_stream = self.per_kv * (self.prompt + age) / self.cache_tokens
        return self.a / per_stream * (1 / KneeLimitConfig().marginal_fraction - 1)


def _aged(ctl: KneeLimit, cohort: AgingCohort, start: int, kv: bool = True) -> None:
    """A window of 40 streams 1,400 tokens into their outputs."""
    c, age = 40, 1400
    for t in range(start, start + 7):
        ctl.update(
            sample(
                t,
                in_flight=c,
                output_tokens_per_s=c / cohort.y(c, age),
                engine_kv_usage=cohort.usage(c, age) if kv else None,
            )
        )


def test_the_kv_line_reads_the_knee_whatever_the_streams_ages() -> None:
    # solo is measured on young streams (4 of them, 16 tokens into their outputs);
    # the streams measured later are old and hold more KV each.
    cohort = AgingCohort()
    young = Solo(cohort.y(4, 16), 4.0, cohort.usage(4, 16))
    ctl = KneeLimit(KneeLimitConfig(knee_smoothing_s=0), start=40, solo=young)
    _aged(ctl, cohort, 0)
    assert ctl.knee == pytest.approx(cohort.knee(40, 1400), rel=1e-6)
    # The line in streams takes the young streams' KV for every stream's: a too low.
    streams = KneeLimit(KneeLimitConfig(knee_smoothing_s=0), start=40, solo=young[:2])
    _aged(streams, cohort, 0)
    assert streams.knee is not None and streams.knee < 0.9 * cohort.knee(40, 1400)


def test_without_kv_usage_the_knee_comes_from_the_line_in_streams() -> None:
    # No /metrics now (or never): the line through (4, solo) and (40, y), as before.
    cohort = AgingCohort()
    solo, y = cohort.y(4, 16), cohort.y(40, 1400)
    per_stream = (y - solo) / 36
    expected = (solo - 4 * per_stream) / per_stream * (1 / 0.35 - 1)
    for learned in (Solo(solo, 4.0, cohort.usage(4, 16)), Solo(solo, 4.0)):
        ctl = KneeLimit(KneeLimitConfig(knee_smoothing_s=0), start=40, solo=learned)
        _aged(ctl, cohort, 0, kv=False)
        assert ctl.knee == pytest.approx(expected, rel=1e-6)
    # kv now but none at the solo window: the same line
    ctl = KneeLimit(KneeLimitConfig(knee_smoothing_s=0), start=40, solo=Solo(solo, 4.0))
    _aged(ctl, cohort, 0)
    assert ctl.knee == pytest.approx(expected, rel=1e-6)


def test_the_knee_estimate_rises_slowly_and_falls_quickly() -> None:
    def k_of(y: float) -> float:  # the line from (0, 0.015) at 40 in flight
        return 0.015 / ((y - 0.015) / 40) * (1 / 0.35 - 1)

    ctl = carried(40, solo=0.015)
    _steady(ctl, 0, 6, y=0.040)  # the first estimate is taken as it is
    assert ctl.knee == pytest.approx(k_of(0.040))
    _steady(ctl, 6, 60, y=0.030)  # a higher k, for 60 s: one time constant
    start = ctl.knee
    assert start is not None
    rise = (start - k_of(0.040)) / (k_of(0.030) - k_of(0.040))
    assert rise == pytest.approx(1 - math.exp(-1), abs=0.02)
    _steady(ctl, 66, 15, y=0.040)  # lower again, for 15 s: one time constant
    assert ctl.knee is not None
    fall = (start - ctl.knee) / (start - k_of(0.040))
    assert fall == pytest.approx(1 - math.exp(-1), abs=0.02)


def _raised_to(ctl: KneeLimit, target: int) -> int:
    """Steady windows whose estimate asks for more, until the ramp reaches ``target``."""
    t = 0
    while ctl.limit < target:
        ctl.update(sample(t, in_flight=ctl.limit, output_tokens_per_s=ctl.limit / 0.020))
        t += 1
        assert t < 60, "no raise"
    return t


def test_a_breach_at_or_below_the_level_before_a_raise_is_not_the_raises() -> None:
    # An L40S at 39 raised to 43, redeployed 2 s later on an L4 whose token budget
    # admits 17 of the retried streams: their prefills breach at 17. The raise admitted
    # nothing there; the breach is at a level the budget held, and the limit comes
    # down to 17, not below, also while the window still holds the breach after the cut.
    knobs = dict(max=43, knee_smoothing_s=0)
    ctl = carried(39, solo=0.015, **knobs)
    t = _raised_to(ctl, 43) + 2
    for now in range(t, t + 8):
        ctl.update(sample(now, in_flight=17, ttft_p95=2.6, output_tokens_per_s=17 / 0.020))
    assert ctl.limit == 17 and ctl.ceiling == 17
    for now in range(t + 8, t + 120):
        ctl.update(sample(now, in_flight=17, ttft_p95=0.2, output_tokens_per_s=17 / 0.020))
        assert ctl.limit == 17
    # Above the level before the raise, the same breach is the raise's prefills': the
    # ceiling keeps its margin (and is re-examined after breach_ttl_s).
    ctl = carried(39, solo=0.015, **knobs)
    t = _raised_to(ctl, 43) + 2
    ctl.update(sample(t, in_flight=43, ttft_p95=0.6, output_tokens_per_s=43 / 0.020))
    assert ctl.ceiling == 43 and ctl.limit == 35  # 0.8 * 43, rounded up


def test_a_reload_carries_the_kv_held_when_solo_was_measured() -> None:
    cohort = AgingCohort()
    ctl = KneeLimit(KneeLimitConfig(initial=40))
    for t in range(7):  # a fresh start: solo at the first level, 4 young streams
        ctl.update(
            sample(
                t,
                in_flight=4,
                output_tokens_per_s=4 / cohort.y(4, 16),
                engine_kv_usage=cohort.usage(4, 16),
            )
        )
    learned = ctl.learned
    assert learned is not None and learned.kv_usage is not None
    assert learned.per_token_s == pytest.approx(cohort.y(4, 16)) and learned.running == 4.0
    assert learned.kv_usage == pytest.approx(cohort.usage(4, 16))
    successor = reconfigure(ctl, KneeLimitConfig(initial=40, knee_smoothing_s=0))
    assert isinstance(successor, KneeLimit)
    _aged(successor, cohort, 7)
    assert successor.knee == pytest.approx(cohort.knee(40, 1400), rel=1e-6)
