"""The ``knee`` limit controller (kneecap's default).

Goal: hold each backend at the largest concurrency at which (a) windowed p95
TTFT and ITL meet the SLO and (b) one more permit still buys enough throughput.
Past that knee an engine keeps adding a little throughput while latency grows
(Qwen3-4B on an L40S: +16 % tokens/s from 32 to 64 in flight for ~7x p95 TTFT),
so the knee, not the throughput peak, is the operating point.

Every sample (L = current limit, c = the sample's in_flight)::

    pressure = max(ttft_p95 / ttft_p95_slo, itl_p95 / itl_p95_slo)   # None parts skipped
    headroom = 1 - pressure                                          # 0.5 if both None

    Decrease, at most once per settle_s (the window still holds a breach for a while).
    A sample judges the concurrency c it saw, not L, and vouches for at most
      1. engine queueing  engine_waiting > tolerance -> c - engine_waiting (what it runs)
      2. SLO breach       pressure > 1 -> c * clamp(1 / pressure, 0.5, backoff)
    if that is below L:   L = max(L / 2, min(L - 1, vouched)); ceiling = min(L, c)
    (Judging c matters after a cut: requests admitted under the old limit drain
    slowly and keep filling the window; cutting again for them would overshoot.)

    Everything else waits until the level is settled: in_flight <= L has held
    for settle_s (a cut is "reached" only once the old admissions drained), and,
    when rule 4 is on, judge_samples samples were taken there.
      3. hold             in_flight < busy_fraction * L: not the bottleneck
      4. diminishing returns (off when marginal_fraction = 0)
         T(x) = tokens/s remembered at level x (busy samples, EWMA);
         R = highest remembered level <= L * (1 - marginal_span):
         worth it  <=>    (T(L) - T(R)) / (L - R) >= marginal_fraction * T(R) / R
           not worth, L was just reached by a probe  -> undo the probe, ceiling = L
           not worth otherwise                        -> hold
           no R                          -> measure one: go to L * (1 - marginal_span)
                             until settled, then return to L (a probe, so judged);
                             at most once per ceiling_ttl_s from the same level
         A probe is judged once, on its first settled samples.
      5. probe up         demand > 0 and headroom >= min_headroom; step =
           slow start (fresh, nothing decreased yet)  L * probe_growth * headroom
           below an active ceiling C                  (C - 1 - L) * headroom / 2, up to C - 1
           after the ceiling expired                  1, 2, 4, ... (doubling), at most
                                                      the slow-start step
         and at least 1.
    Raises are granted at ramp_per_s permits per second (one second assumed until
    two samples give the cadence), and so is a fresh start from 0 up to
    ``initial``: N permits at once are N prefills queued behind each other, a TTFT
    spike caused by the raise itself. Settling starts when the ramp ends.

Why so: slow start finds the neighbourhood in a few settle periods; once a
ceiling is known the controller creeps, so the steady state is a small sawtooth
under the knee. The ceiling expires (ceiling_ttl_s) so that a faster backend is
re-probed; re-probing starts at one permit because an engine's TTFT gives little
warning before its cliff (flat until the KV cache or token budget runs out).
Rule 4 compares levels marginal_span apart, not neighbours: near the knee one
permit adds ~1 % of throughput, far below the noise of a windowed rate; and it
only ever undoes a step it has just measured both ends of, so noisy or stale
memories cannot drive a chain of cuts. Memories expire (memory_ttl_s) and are
all dropped when a level's throughput jumps by more than drift_tolerance.

Defaults and why:
  ttft_p95_slo 0.5 s, itl_p95_slo 0.1 s (10 tokens/s per stream, faster than
      people read; 50 ms would pin an L4, ~37 ms per step alone, near 1)
  marginal_fraction 0.4, marginal_span 0.25: on a decode-bound engine the ratio
      marginal/average permit throughput is ~ITL(1)/ITL(c), so 0.4 stops where a
      stream decodes at 40 % of its solo speed; the seed figures' 32 -> 64 step
      (5.4 tok/s per permit against 34 at 32, i.e. 0.16) is far past it
  probe_growth 0.5, min_headroom 0.1, backoff 0.9, busy_fraction 0.9
  settle_s 5 s (keep it >= the gateway's sample window), judge_samples 3,
  ramp_per_s 4 (four 1K-token prefills are ~0.2 s on an L40S)
  ceiling_ttl_s 60 s, memory_ttl_s 600 s, drift_tolerance 0.25, tolerance 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from policies.base import LimitBounds, Sample

_NO_EVIDENCE_HEADROOM = 0.5  # probe moderately when no latency percentile exists yet
_SMOOTHING = 0.5  # EWMA weight of the newest tokens/s at a level
_MAX_CUT = 0.5  # no single decrease removes more than half the limit


class KneeLimitConfig(LimitBounds):
    kind: Literal["knee"] = "knee"
    ttft_p95_slo: float = Field(default=0.5, gt=0)
    itl_p95_slo: float = Field(default=0.1, gt=0)
    marginal_fraction: float = Field(default=0.4, ge=0, le=1)
    marginal_span: float = Field(default=0.25, gt=0, lt=1)
    probe_growth: float = Field(default=0.5, gt=0)
    min_headroom: float = Field(default=0.1, ge=0, lt=1)
    backoff: float = Field(default=0.9, ge=_MAX_CUT, lt=1)
    busy_fraction: float = Field(default=0.9, gt=0, le=1)
    engine_waiting_tolerance: int = Field(default=0, ge=0)
    settle_s: float = Field(default=5.0, ge=0)
    ramp_per_s: float = Field(default=4.0, gt=0)
    judge_samples: int = Field(default=3, ge=1)
    ceiling_ttl_s: float = Field(default=60.0, ge=0)
    memory_ttl_s: float = Field(default=600.0, ge=0)
    drift_tolerance: float = Field(default=0.25, gt=0)


@dataclass(slots=True)
class _Level:
    tokens_per_s: float
    at: float


class KneeLimit:
    def __init__(self, config: KneeLimitConfig, start: int | None = None) -> None:
        self._cfg = config
        # A carried-over limit was found by measurement: resume carefully, no slow start.
        self._slow_start = start is None
        self._target = config.clamp(config.initial if start is None else start)
        # A raise is granted gradually (see _ramp), and so is a fresh start: a gateway
        # starting in front of waiting clients would otherwise send `initial`
        # prefills at once. A carried-over limit already has its load.
        first = self._target if start is not None else config.ramp_per_s
        self._limit = config.clamp(min(self._target, first))
        self._last_now: float | None = None
        self._elapsed = 1.0  # since the previous sample
        self._reached_at: float | None = float("-inf")  # None until in_flight <= limit
        self._busy_samples = 0  # settled busy samples at this level
        self._decreased_at = float("-inf")
        self._last_step = 0  # > 0 while the current level was reached by a probe
        self._reprobe_step = 1
        self._ceiling: int | None = None
        self._ceiling_until = float("-inf")
        self._levels: dict[int, _Level] = {}
        self._resume_at: int | None = None  # set while measuring a reference level
        self._measured = (0, float("-inf"))  # (level measured from, when)

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def ceiling(self) -> int | None:
        """The lowest level recently found too high, while it is remembered."""
        return self._ceiling

    def update(self, sample: Sample) -> int:
        cfg = self._cfg
        now = sample.now
        # The sampling period paces the ramp; one second until two samples tell.
        self._elapsed = 1.0 if self._last_now is None else now - self._last_now
        self._last_now = now
        self._forget(now)
        pressure = self._pressure(sample)
        if now - self._decreased_at >= cfg.settle_s:
            vouched = self._vouched(sample, pressure)
            if vouched < self._limit:
                return self._decrease(now, vouched, failed=min(self._limit, sample.in_flight))
        if self._limit < self._target:
            return self._ramp(now)
        if not self._settled(sample):
            return self._limit
        if sample.in_flight < cfg.busy_fraction * self._limit:
            return self._limit  # not the bottleneck: nothing to learn, nothing to gain
        judging = cfg.marginal_fraction > 0
        if judging:
            self._remember(now, sample.output_tokens_per_s)
            self._busy_samples += 1
            if self._busy_samples < cfg.judge_samples:
                return self._limit
            if self._resume_at is not None:  # the reference is measured: go back
                return self._increase(now, self._resume_at - self._limit)
            worth = self._worth_it()
            probed, self._last_step = self._last_step, 0  # a probe is judged once
            if worth is False and probed:
                return self._decrease(now, self._limit - probed, failed=self._limit)
            if worth is None and self._may_measure(now, sample.demand):
                return self._measure(now)
            if worth is False:
                return self._limit  # past the knee by stale or unjudged memories: hold
        headroom = _NO_EVIDENCE_HEADROOM if pressure is None else 1 - pressure
        if sample.demand <= 0 or headroom < cfg.min_headroom:
            return self._limit
        step = self._probe_step(headroom)
        return self._increase(now, step) if step > 0 else self._limit

    def _vouched(self, sample: Sample, pressure: float | None) -> float:
        """The highest concurrency this sample does not object to (rules 1 and 2)."""
        vouched = float("inf")
        waiting = sample.engine_waiting
        if waiting is not None and waiting > self._cfg.engine_waiting_tolerance:
            vouched = sample.in_flight - waiting
        if pressure is not None and pressure > 1:
            factor = max(_MAX_CUT, min(self._cfg.backoff, 1 / pressure))
            vouched = min(vouched, sample.in_flight * factor)
        return vouched

    def _pressure(self, sample: Sample) -> float | None:
        ratios = [
            value / slo
            for value, slo in (
                (sample.ttft_p95, self._cfg.ttft_p95_slo),
                (sample.itl_p95, self._cfg.itl_p95_slo),
            )
            if value is not None
        ]
        return max(ratios) if ratios else None

    def _settled(self, sample: Sample) -> bool:
        if self._reached_at is None:
            if sample.in_flight > self._limit:
                return False  # admissions of a higher limit are still draining
            self._reached_at = sample.now
        return sample.now - self._reached_at >= self._cfg.settle_s

    def _forget(self, now: float) -> None:
        if self._ceiling is not None and now >= self._ceiling_until:
            self._ceiling = None
        ttl = self._cfg.memory_ttl_s
        for x in [x for x, level in self._levels.items() if now - level.at > ttl]:
            del self._levels[x]

    def _remember(self, now: float, tokens_per_s: float) -> None:
        known = self._levels.get(self._limit)
        if known is not None and known.tokens_per_s > 0:
            if abs(tokens_per_s / known.tokens_per_s - 1) > self._cfg.drift_tolerance:
                self._levels.clear()  # the backend changed: every level is suspect
                known = None
        if known is None:
            self._levels[self._limit] = _Level(tokens_per_s, now)
        else:
            known.tokens_per_s += _SMOOTHING * (tokens_per_s - known.tokens_per_s)
            known.at = now

    def _reach(self) -> float:
        return self._limit * (1 - self._cfg.marginal_span)

    def _worth_it(self) -> bool | None:
        """Rule 4's verdict on the current level; None without a reference level."""
        ref = max((x for x in self._levels if x <= self._reach()), default=None)
        if ref is None:
            return None
        here = self._levels[self._limit].tokens_per_s
        ref_tput = self._levels[ref].tokens_per_s
        gain_per_permit = (here - ref_tput) / (self._limit - ref)
        return gain_per_permit >= self._cfg.marginal_fraction * ref_tput / ref

    def _probe_step(self, headroom: float) -> int:
        if self._ceiling is not None:
            room = self._ceiling - 1 - self._limit
            return min(room, max(1, int(room * headroom / 2)))
        growth = self._limit * self._cfg.probe_growth
        if self._slow_start:
            return max(1, round(growth * headroom))
        step = min(self._reprobe_step, round(growth * headroom))
        self._reprobe_step *= 2
        return max(1, step)

    def _ramp(self, now: float) -> int:
        """Move towards the target by ramp_per_s: N permits granted at once would be N
        prefills queued behind each other, a TTFT spike the raise itself caused."""
        allowance = max(1, int(self._cfg.ramp_per_s * self._elapsed))
        self._limit = min(self._target, self._limit + allowance)
        if self._limit == self._target:
            self._reached_at = now
        return self._limit

    def _set(self, limit: int, *, reached_at: float | None) -> int:
        self._limit = self._target = limit
        self._reached_at = reached_at
        self._busy_samples = 0
        return limit

    def _may_measure(self, now: float, demand: int) -> bool:
        level, at = self._measured
        return (
            demand > 0  # so that the lower level is busy and can be measured
            and self._cfg.min <= int(self._reach()) < self._limit
            and (level != self._limit or now - at >= self._cfg.ceiling_ttl_s)
        )

    def _measure(self, now: float) -> int:
        self._measured = (self._limit, now)
        self._resume_at = self._limit
        return self._set(int(self._reach()), reached_at=None)

    def _increase(self, now: float, step: int) -> int:
        self._resume_at = None
        new = self._cfg.clamp(self._limit + step)
        if new == self._limit:
            return new
        self._last_step = new - self._limit
        self._set(self._limit, reached_at=None)
        self._target = new
        return self._ramp(now)

    def _decrease(self, now: float, target: float, *, failed: int) -> int:
        self._slow_start = False
        self._resume_at = None
        self._ceiling = max(failed, 1)
        self._ceiling_until = now + self._cfg.ceiling_ttl_s
        self._last_step = 0
        self._reprobe_step = 1
        self._decreased_at = now
        cut = self._cfg.clamp(max(self._limit * _MAX_CUT, min(self._limit - 1, target)))
        return self._set(cut, reached_at=None)
