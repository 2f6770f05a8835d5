"""The ``knee`` limit controller (kneecap's default).

Goal: hold each backend at the largest concurrency at which (a) it does not
object -- no queue inside the engine, windowed p95 TTFT and ITL within the
SLO -- and (b) one more permit still buys enough throughput.

(b) is measured through decode speed, not by comparing throughputs. A decode
step reads the weights once (time ``a``, whatever the batch) plus the KV cache
of every running sequence, so a stream's time per token is ``y(c) = a + b(c)``
with ``b`` growing with the tokens held, and throughput is ``T(c) = c / y(c)``.
For ``b`` linear in c the marginal permit yields ``a / y(c)`` of an average
permit's throughput: a stream's slowdown against decoding alone *is* the
marginal-throughput signal, and it is read from every window rather than from
two noisy windowed rates taken at two limits minutes apart. The gateway's
window gives ``y = running / tokens_per_s``; ``solo`` is measured once, at the
low concurrency a fresh start begins with. ``b`` grows with the KV a stream
holds, which grows with its age: where the engine's KV cache usage is scraped,
y is a line in the KV held, not in the streams, and ``a`` comes out exact
whatever the streams' ages.

Every sample (L = limit, c = in_flight, W = engine_waiting, S = settle_s)::

    pressure = max(ttft_p95 / ttft_p95_slo, itl_p95 / itl_p95_slo)   # None parts skipped

    1. objection, judged on c (what the window saw), not on L:
         engine queueing, W > tolerance for S -> the backend holds H = max(c - W)
             over the last S (a burst of admissions queues for a few steps, so W
             counts only from S after the last raise; a full KV cache queues for
             good; the max, because right after a burst of completions the
             preempted sequences count as waiting while they are prefilled again)
         SLO breach, pressure > 1             -> it held H = c, too slowly
       ceiling C = min(C, H), forgotten ceiling_ttl_s after the last objection, or
       breach_ttl_s after a breach within 2 S of a raise with c above the limit
       before the raise (the burst of prefills a raise admits can breach by itself;
       at or below that level the raise admitted nothing: an L4 redeployed 5 s
       after a raise, its retries held at 17 by the token budget, breaches by
       itself, and read as the raise's it got the margin below 17, 14);
       a breach the window still holds within S of the cut it caused keeps the
       margin it was given (at the level the cut set, c = L, it would otherwise read
       as an objection at a level the limit holds);
       at most once per S (a window still holds a breach for a while):
         L = max(L / 2, min((1 - margin) * H, c / pressure))  if that is < L
             (the c / pressure term only for a breach)
       two exceptions, neither while the engine queues nor within 2 S of a raise
       (as above):
         turnover: a breach within 2 S of a window in which at least c / 4 requests
             completed, more than 4 times as many as in the window S before, is that
             of clients that finished together coming back together: their prefills
             breach whatever the limit (after an L4 redeploy every static limit from 6
             to 19 breaches at each cohort's turnover, p95 TTFT 0.61-0.65 s) and a
             lower limit would only cost throughput for the minutes the cohort runs.
             No ceiling; L = max(L / 2, c) if that is < L (admit no more than that)
         a level the limit did not set, c < L (the token budget or the demand held
             in flight below the limit): L = max(L / 2, H) if that is < L, and the
             ceiling keeps no margin below H. The margin keeps the limit off a cliff
             it walked onto; here the budget set the level and holds it whatever the
             limit above, so the limit comes down to it, not below; the next
             objection is at a level the limit holds and goes below as usual
    2. the knee estimate, from a window's worth (S) of samples, c = their mean in_flight:
         running = c, or c - W once the engine has queued for S (a full KV cache);
                   no estimate while c > L and the engine queued within the last S
                   (the window still holds it): a backlog the limit already refuses
                   (after a cut, or from the faster backend a slower one replaced),
                   preempted and recomputed, tells nothing of the knee
         y       = running / tokens_per_s          # s per token of one stream
         solo    = y at running = c0, measured at the first level of a fresh start
                   (busy and steady), again whenever c <= solo_level; a y below solo
                   at a higher c (a faster backend) replaces it, with c0 = 0
         u       = the engine's KV cache usage, mean over the same samples (None
                   unless every one of them had it); u0 = u at the solo window
         k       = a / b * (1 / marginal_fraction - 1), the c at which
                   y = a / marginal_fraction, a and b from the KV line through
                   (u0, solo) and (u, y): slope s = (y - solo) / (u - u0),
                   a = solo - s * u0, b = s * u / running (the KV the average stream
                   holds now, at its age now). Without u or u0 (no engine /metrics),
                   the line through (c0, solo) and (running, y): b = (y - solo) /
                   (running - c0), a = solo - b * c0, which takes every stream to hold
                   the same KV at every age. solo is measured on young streams (their
                   KV little more than the prompt): 14.3 ms a token where a steady 4 in
                   flight run 14.9, so that line puts a low and K at ~40 where the
                   static sweep's line gives ~44; the KV line holds 39-46.
                   Capped at 2 * running: a capped k is only a floor of the knee
       steady windows (in_flight within +-steady_tolerance) feed
         K = EWMA of k, time constant knee_smoothing_s when k > K,
             * down_speedup when k < K, * queueing_slowdown while the KV cache is
             full (its requests are the oldest, the slowest there will be);
             (a closed loop's cohorts age together: k rises as one turns over and
             falls as it ages; slow to rise and quick to fall keeps K near the
             aged cohort's, below the KV cliff);
             before a first uncapped k, K is the highest floor (it may raise L,
             never lower it)
       and the drift check: a stable stretch of y (S of samples within
       drift_tolerance / 2) more than drift_tolerance above the last stable one at
       the same or a higher c (within steady_tolerance), S to 6 S earlier, moved to
       this c along its line from solo (y_then - solo scaled by (c - c0) /
       (c_then - c0)), means a slower backend. Fewer streams, each slower: on one
       backend y only grows with c, and requests age slowly (their KV grows with
       every token) while a replaced backend changes y at once; at more streams the
       line would extrapolate and an older cohort could pass for a slower backend.
       Measured (y over expected): at most 1.17 in 20 convergence runs (initial 4 and
       128, seeds 0-4, with and without the token budget) and 18 Poisson runs (0.4,
       0.81, 1.2 req/s, seeds 0-2, both ways); 1.9 after an L4 redeploy at 41 in
       flight both sides, 2.23 when the token budget shows it at 17. Then solo is
       forgotten and K restarts: y and k as if no solo had been measured (y bounds
       the new solo from above, k the knee), no slow start, until c <= solo_level
       measures solo again. Rescaling solo by the ratio was tried: it compares two
       populations of different ages (a redeploy restarts every stream young, the
       old stretch held aged ones) and made the L4's solo 31 ms (27 ms at like loads)
       for a measured 38 ms; as the new cohort aged the estimate fell below 12, the
       limit with it (budget on: the L4's budget holds 17).
       Only a rise counts: clients that finished together and restart together make
       y fall at the same c (a young cohort for an old one); a faster backend shows
       as y below solo.
    3. raises are granted at ramp_per_s permits per second, and so is a fresh start,
       from solo_level up to ``initial`` (after holding solo_level for S to measure
       solo): N permits at once are N prefills queued behind each other, a TTFT spike
       the raise itself caused. A raise stops early where this sample's (uncapped) k
       says the knee is.
    4. goal G = min(K, (1 - margin) * C), no margin for a ceiling set at a level the
       limit did not set (rule 1):
         L > G * (1 + deadband), at most once per S -> L = max(G, L * (1 - max_step))
             (k judges what was in flight, so this need not wait for a drain)
       everything else waits until L is settled (in_flight <= L held for S):
         in_flight < busy_fraction * L or no demand     -> hold (not the bottleneck)
         no K or no measured solo yet: a fresh start    -> L = L * (1 + max_step)
                                       a carried limit  -> hold (it only backs off)
                                       (and one carried onto a slower backend, rule 2)
         L < G * (1 - deadband)                         -> L = min(G, L * (1 + max_step))
         otherwise                                      -> hold
       On reload a knee controller hands its measured solo (with its c0 and u0) to
       its successor, which starts at the carried limit without ramp or solo phase.

Why so: the estimate reacts within one window and needs no probing, so there
is no sawtooth; the deadband and the smoothing keep the limit still while
requests age. The objections catch what the estimate cannot see: a KV cache
that runs out (requests wait inside the engine and their TTFT jumps from
~0.1 s to seconds), a prefill storm, a backend that got slower; the margin
keeps the limit off that cliff and the ceiling keeps the estimate from walking
back onto it for ceiling_ttl_s. Limits of the model: a change of weight format
alone (FP8 for BF16 weights) moves ``a`` but barely ``y`` at high concurrency,
so it is seen only when the restart's transient is (the breach of the retried
streams' prefills, whose ceiling holds for ceiling_ttl_s), or at the next fresh
start. After a slower backend the estimate can lower the limit but not raise it
until solo is measured again, which takes a window at solo_level: under a
steady load the limit stays where the objections and the token budget left it.

Defaults and why:
  ttft_p95_slo 0.5 s; itl_p95_slo 0.15 s (~6.5 tokens/s per stream, about reading
      speed; a window's p95 catches the prefill stalls a burst of admissions causes)
  marginal_fraction 0.35: stop where a stream decodes at about a third of its solo
      speed, the marginal permit bringing about a third of an average one. The seed
      figures' step from 32 to 64 in flight brings 5.4 tok/s per permit against 34 at
      32 (0.16): far past it; on the simulated L40S this lands at 39-46 in flight.
      Lower buys throughput with slower streams: 90 % of the goodput of the best
      static limit under 2x Poisson overload with the request limit alone (80 in
      flight, at the KV-cache cliff of staggered requests) would need about 0.26 or
      less, which puts the limit under 128 closed-loop clients at 47-52, settling
      only after 160-320 s (README, "Acceptance")
  margin 0.2: 20 % below where the backend objected leaves a fifth of the KV cache
      for requests that are still growing
  knee_smoothing_s 60, down_speedup 0.25 (60 s on rises, 15 s on falls; with the KV
      line, 30 s on rises let K follow young cohorts up: 4 of the 10 convergence runs
      settled only after 330-570 s),
      queueing_slowdown 2, deadband 0.1, max_step 0.5, steady_tolerance 0.1,
      busy_fraction 0.9
  settle_s 5 s (keep it >= the gateway's sample window), ramp_per_s 4 and
      solo_level 4 (four 1K-token prefills are ~0.2 s on an L40S; four streams decode
      within ~10 % of one alone)
  ceiling_ttl_s 600 s, breach_ttl_s 60 s, drift_tolerance 0.5, engine_waiting_tolerance 0
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal, NamedTuple

from pydantic import Field

from policies.base import LimitBounds, Sample

_MAX_CUT = 0.5  # no single decrease removes more than half the limit
_CAP = 2.0  # one sample never suggests more than twice what it saw


class KneeLimitConfig(LimitBounds):
    kind: Literal["knee"] = "knee"
    ttft_p95_slo: float = Field(default=0.5, gt=0)
    itl_p95_slo: float = Field(default=0.15, gt=0)
    marginal_fraction: float = Field(default=0.35, gt=0, lt=1)
    margin: float = Field(default=0.2, ge=0, lt=1)
    knee_smoothing_s: float = Field(default=60.0, ge=0)
    down_speedup: float = Field(default=0.25, gt=0, le=1)
    queueing_slowdown: float = Field(default=2.0, ge=1)
    deadband: float = Field(default=0.1, ge=0, lt=1)
    max_step: float = Field(default=0.5, gt=0)
    steady_tolerance: float = Field(default=0.1, ge=0)
    busy_fraction: float = Field(default=0.9, gt=0, le=1)
    engine_waiting_tolerance: int = Field(default=0, ge=0)
    settle_s: float = Field(default=5.0, ge=0)
    ramp_per_s: float = Field(default=4.0, gt=0)
    solo_level: int = Field(default=4, ge=1)
    ceiling_ttl_s: float = Field(default=600.0, ge=0)
    breach_ttl_s: float = Field(default=60.0, ge=0)
    drift_tolerance: float = Field(default=0.5, gt=0)


class Solo(NamedTuple):
    """A stream's time per token at low concurrency, and where it was measured."""

    per_token_s: float
    running: float  # streams running then (0: a bound from above, no measurement)
    kv_usage: float | None = None  # the engine's KV cache in use then, if scraped


class KneeLimit:
    def __init__(
        self,
        config: KneeLimitConfig,
        start: int | None = None,
        *,
        solo: tuple[float, float] | Solo | None = None,
    ) -> None:
        """``start``: a carried-over limit; ``solo``: what a predecessor measured."""
        self._cfg = config
        self._slow_start = start is None
        self._target = config.clamp(config.initial if start is None else start)
        # A fresh start measures `solo` at solo_level, then ramps up (see _ramp); a
        # carried-over limit already has its load and keeps it.
        first = self._target if start is not None else config.solo_level
        self._limit = config.clamp(min(self._target, first))
        self._measuring_solo = start is None
        self._last_now: float | None = None
        self._elapsed = 1.0  # since the previous sample
        # None until in_flight <= limit; a fresh start holds its first level to measure solo
        self._reached_at: float | None = None if start is None else float("-inf")
        self._decreased_at = float("-inf")
        self._cut_at = float("-inf")  # when an objection last cut the limit
        self._raised_at = float("-inf")  # when a ramp last granted permits ...
        self._raised_from = self._limit  # ... and the limit before that raise began
        self._turnover_at = float("-inf")  # when clients last came back all at once
        self._ceiling: int | None = None
        self._ceiling_margin = config.margin  # kept below the ceiling, see _objection
        self._ceiling_until = float("-inf")
        self._queueing_since: float | None = None  # engine_waiting > tolerance since
        self._queued_at = float("-inf")  # engine_waiting > tolerance last seen
        self._running: deque[tuple[float, int]] = deque()  # (now, in_flight - waiting) since
        # (now, in_flight, completed, engine_kv_usage)
        self._recent: deque[tuple[float, int, int, float | None]] = deque()
        self.solo: float | None = None  # s per token of a stream at low concurrency ...
        self._solo_c = 0.0  # ... namely at this many running ...
        self._solo_kv: float | None = None  # ... holding this much KV cache, if known
        self._solo_measured = False  # False while solo is only an upper bound
        if solo is not None:
            self.solo, self._solo_c, self._solo_kv = Solo(*solo)
            self._solo_measured = True
        self.knee: float | None = None  # the smoothed estimate K ...
        self._knee_is_floor = False  # ... or only a lower bound of the knee
        self._instant: float | None = None  # this sample's knee estimate, steady or not
        self._recent_y: deque[tuple[float, float]] = deque()  # (now, y) of steady samples
        self._stable: deque[tuple[float, float, float]] = deque()  # (now, c, y) when stable

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def ceiling(self) -> int | None:
        """The lowest concurrency at which the backend recently objected."""
        return self._ceiling

    def update(self, sample: Sample) -> int:
        cfg = self._cfg
        now = sample.now
        self._elapsed = 1.0 if self._last_now is None else now - self._last_now
        self._last_now = now
        if self._ceiling is not None and now >= self._ceiling_until:
            self._ceiling = None
        pressure = self._pressure(sample)
        held = self._held(sample, pressure)
        self._observe(sample)
        self._note_turnover(sample)
        if held is not None:
            cut = self._objection(sample, held, pressure)
            if cut is not None and cut < self._limit:
                return self._decrease(now, cut)
        if self._limit < self._target and not self._measuring_solo:
            if self._instant is not None and self._limit >= self._instant:
                self._target = self._limit  # the raise went past the knee: stop it here
            else:
                return self._ramp(now)
        goal = self._goal()
        if (
            goal is not None
            and not (self._knee_is_floor and goal == self.knee)
            and self._limit > goal * (1 + cfg.deadband)
            and now - self._decreased_at >= cfg.settle_s
        ):
            # The estimate judges what was in flight, so it need not wait for a drain.
            self._decreased_at = now
            return self._lower(now, max(goal, self._limit * (1 - cfg.max_step)))
        if not self._settled(sample):
            return self._limit
        if self._measuring_solo:
            if self.solo is None:
                return self._limit  # hold the first level until a busy window is measured
            self._measuring_solo = False
            if self._limit < self._target:
                return self._ramp(now)
        busy = sample.in_flight >= cfg.busy_fraction * self._limit
        if not busy or sample.demand <= 0:
            return self._limit  # not the bottleneck: nothing to gain
        if goal is None or not self._solo_measured:
            if not self._slow_start:
                return self._limit  # a carried limit is kept until solo is measured
            return self._raise(now, self._limit * (1 + cfg.max_step))  # slow start
        if self._limit < goal * (1 - cfg.deadband):
            return self._raise(now, min(goal, self._limit * (1 + cfg.max_step)))
        return self._limit

    # -- the knee estimate ---------------------------------------------------

    def _observe(self, sample: Sample) -> None:
        """Rule 3: fold a steady window into `solo` and the knee estimate."""
        cfg = self._cfg
        self._instant = None
        recent = self._recent
        recent.append((sample.now, sample.in_flight, sample.completed, sample.engine_kv_usage))
        horizon = sample.now - cfg.settle_s
        while len(recent) > 1 and recent[1][0] <= horizon:
            recent.popleft()  # keep the last sample at or before the horizon
        if recent[0][0] > horizon + self._elapsed / 2 or len(recent) < 2:
            return  # not yet a window's worth of history
        levels = [c for _, c, _, _ in recent]
        c = sum(levels) / len(levels)
        usages = [u for _, _, _, u in recent if u is not None]
        kv = sum(usages) / len(usages) if len(usages) == len(recent) else None
        if c < 1 or sample.output_tokens_per_s <= 0:
            return
        if sample.in_flight > self._limit and sample.now - self._queued_at < cfg.settle_s:
            # More in flight than the limit admits, on an engine that queued within the
            # window: a backlog the limit already refuses (after a cut, or a slower
            # backend taking over), preempted and recomputed. No measure of the knee.
            return
        running = c
        if self._queueing_since is not None:
            if sample.now - self._queueing_since < cfg.settle_s:
                return  # a burst of prefills: the window says little about decoding
            running = max(1.0, c - (sample.engine_waiting or 0))  # a full KV cache
        y = running / sample.output_tokens_per_s
        steady = max(levels) - min(levels) <= cfg.steady_tolerance * c
        if self._measuring_solo:
            if steady and c >= cfg.busy_fraction * self._limit:
                # the latest busy window there
                self.solo, self._solo_c, self._solo_kv = y, running, kv
                self._solo_measured = True
            return
        if self.solo is None:
            if not steady:
                return
            # No low-concurrency window: y is an upper bound of solo, which makes k an
            # upper bound of the knee. Good enough to lower the limit, not to raise it.
            self.solo, self._solo_c, self._solo_kv = y, 0.0, 0.0
        k, capped = self._estimate(running, y, kv)
        # Judges a ramp in progress (c is its mean over the window); a capped k says
        # only "more than twice as much", no reason to stop.
        self._instant = None if capped else k
        if not steady:
            return
        if self._queueing_since is None and self._drift(sample.now, c, y):
            return  # k was judged against the old backend's solo
        if c <= cfg.solo_level:
            # at the first level y is solo itself
            self.solo, self._solo_c, self._solo_kv = y, running, kv
            self._solo_measured = True
        elif y < self.solo:
            # Faster than `solo` ever was: a faster backend. y bounds its solo from above.
            self.solo, self._solo_c, self._solo_kv = y, 0.0, 0.0
            self.knee = None
            return
        if self.knee is None or self._knee_is_floor:
            # Until a first real estimate, a capped k ("more than 2 * running") is kept
            # as a floor of the knee: good for raising, not for lowering.
            floor = self.knee if self._knee_is_floor and self.knee is not None else 0.0
            self.knee = max(floor, k) if capped else k
            self._knee_is_floor = capped
            return
        # Quick to believe the knee is lower, slow to believe it is higher; but a
        # full KV cache holds the oldest requests, the slowest there will be.
        down = cfg.down_speedup if running == c else cfg.queueing_slowdown
        tau = cfg.knee_smoothing_s * (1 if k > self.knee else down)
        self.knee += self._weight(tau) * (k - self.knee)

    def _estimate(self, running: float, y: float, kv: float | None) -> tuple[float, bool]:
        """k from the line through solo and (running, y) in KV held, else in streams.

        In KV held (both ends scraped): a = the line's value at an empty cache,
        b = its slope * the KV the average stream holds now. In streams: the line
        through (solo_c, solo) and (running, y), which takes every stream to hold
        at any age what the streams held when solo was measured.
        """
        assert self.solo is not None
        cap = _CAP * running
        if y <= self.solo:
            return cap, True
        if kv is not None and self._solo_kv is not None:
            if kv <= self._solo_kv:
                return cap, True
            slope = (y - self.solo) / (kv - self._solo_kv)  # s per token per cache share
            alone = self.solo - slope * self._solo_kv  # a
            per_seq = slope * kv / running  # b, at the streams' ages now
        else:
            if running <= self._solo_c:
                return cap, True
            per_seq = (y - self.solo) / (running - self._solo_c)  # b
            alone = self.solo - per_seq * self._solo_c  # a
        alone = max(alone, 0.0)  # never below nothing
        k = max(1.0, alone / per_seq * (1 / self._cfg.marginal_fraction - 1))
        return (cap, True) if k >= cap else (k, False)

    def _weight(self, tau: float) -> float:
        return 1.0 if tau <= 0 else 1 - math.exp(-self._elapsed / tau)

    def _drift(self, now: float, c: float, y: float) -> bool:
        """A backend that got slower under load: rescale `solo` by what y did.

        Compares a stable stretch of y (settle_s of samples within
        drift_tolerance / 2 of each other) with the last stable one at about
        the same c (within steady_tolerance, moved to the current c by the
        affine model) settle_s to 6 settle_s earlier. Requests age slowly, so y
        grows little between the two; a slower backend moves it at once and
        for good. Only a rise counts: a fall at the same c is what a young
        cohort replacing an old one looks like (clients that finished together
        and restarted together), and a faster backend shows as y below solo.
        A transient (a burst of prefills after a restart) is not stable and is
        never compared. True when it rescaled.
        """
        assert self.solo is not None
        cfg = self._cfg
        span = cfg.settle_s
        recent = self._recent_y
        recent.append((now, y))
        while recent[0][0] < now - span:
            recent.popleft()
        ys = [v for _, v in recent]
        if now - recent[0][0] < span * 0.8 or max(ys) / min(ys) > 1 + cfg.drift_tolerance / 2:
            return False
        history = self._stable
        while history and history[0][0] < now - 6 * span:
            history.popleft()
        tol = cfg.steady_tolerance * c
        previous = [e for e in history if e[0] <= now - span and c <= e[1] + tol]
        history.append((now, c, y))
        if not previous:
            return False
        _, c_then, y_then = previous[-1]
        # y - solo = b * (c - c0): y_then moved to this c along its line from solo
        share = max(0.0, c - self._solo_c) / max(c_then - self._solo_c, 1.0)
        expected = self.solo + max(0.0, y_then - self.solo) * share
        ratio = (sum(ys) / len(ys)) / expected
        if ratio - 1 <= cfg.drift_tolerance:
            return False
        self._forget_solo()
        self.knee, self._knee_is_floor = None, False
        self._slow_start = False  # the limit is held until solo is measured again
        history.clear()
        return True

    def _forget_solo(self) -> None:
        self.solo, self._solo_c, self._solo_kv, self._solo_measured = None, 0.0, None, False

    def _goal(self) -> float | None:
        goal = self.knee
        if self._ceiling is not None:
            capped = (1 - self._ceiling_margin) * self._ceiling
            goal = capped if goal is None else min(goal, capped)
        return goal

    # -- objections ------------------------------------------------------------

    def _objection(self, sample: Sample, held: int, pressure: float | None) -> float | None:
        """Rule 1: the ceiling an objection sets and the cut it asks for, if any."""
        cfg = self._cfg
        now = sample.now
        c = sample.in_flight
        # A raise breaches through the prefills it admitted: only while more is in
        # flight than the limit before it allowed. At or below that level the raise
        # admitted nothing (a redeploy right after a raise, its retries held by the
        # token budget, is the new backend's objection, not the raise's).
        after_raise = now - self._raised_at <= 2 * cfg.settle_s and c > self._raised_from
        queueing = self._queueing(sample)
        due = now - self._decreased_at >= cfg.settle_s  # a window holds a breach a while
        if not queueing and not after_raise and now - self._turnover_at <= 2 * cfg.settle_s:
            # Clients that finished together came back together: their prefills breach
            # whatever the limit. Admit no more than is in flight, set no ceiling.
            return c if due and c < self._limit else None
        # A level the limit did not set (the token budget or the demand held in flight
        # below it): down to that level, not below, and no margin under it.
        unset = c < self._limit and not after_raise and not queueing
        margin = 0.0 if unset else cfg.margin
        if self._ceiling is not None and now - self._cut_at < cfg.settle_s:
            # The window still holds the breach the last cut answered, now at the level
            # the cut set: the same objection, judged as it was when it came.
            margin = self._ceiling_margin
        if self._ceiling is None or held < self._ceiling:
            self._ceiling, self._ceiling_margin = held, margin
        elif held == self._ceiling:
            self._ceiling_margin = max(self._ceiling_margin, margin)
        # A breach right after a raise may be the burst of prefills the raise itself
        # admitted: that ceiling is re-examined sooner.
        ttl = cfg.breach_ttl_s if after_raise and not queueing else cfg.ceiling_ttl_s
        self._ceiling_until = max(self._ceiling_until, now + ttl)
        if not due:
            return None
        cut = (1 - cfg.margin) * held
        if pressure is not None and pressure > 1:
            cut = min(cut, c / pressure)
        return max(cut, held) if unset else cut

    def _note_turnover(self, sample: Sample) -> None:
        """A quarter of what is in flight completed within the window, four times as
        many as in the window before: clients that finished together, back together."""
        done = sample.completed
        then, _, done_then, _ = self._recent[0]
        if then < sample.now and done >= sample.in_flight / 4 and done > 4 * done_then:
            self._turnover_at = sample.now

    def _held(self, sample: Sample, pressure: float | None) -> int | None:
        """Rule 1: the concurrency this sample says the backend held, if it objects."""
        waiting = sample.engine_waiting
        # A burst of admissions queues for a few steps, and a ramp admits one burst
        # after another; a full KV cache queues for good, with no raise to blame.
        ramping = sample.now - self._raised_at < self._cfg.settle_s
        if waiting is not None and waiting > self._cfg.engine_waiting_tolerance:
            self._queued_at = sample.now
        if waiting is not None and waiting > self._cfg.engine_waiting_tolerance and not ramping:
            if self._queueing_since is None:
                self._queueing_since = sample.now
                self._running.clear()
            running = self._running
            running.append((sample.now, sample.in_flight - waiting))
            while running[0][0] < sample.now - self._cfg.settle_s:
                running.popleft()
            if sample.now - self._queueing_since >= self._cfg.settle_s:
                # The most it ran over settle_s: right after a burst of completions the
                # preempted sequences count as waiting while they are prefilled again.
                return max(1, max(r for _, r in running))
        else:
            self._queueing_since = None
        if pressure is not None and pressure > 1:
            return max(1, sample.in_flight)
        return None

    def _queueing(self, sample: Sample) -> bool:
        """The engine has queued for settle_s: its KV cache is full."""
        since = self._queueing_since
        return since is not None and sample.now - since >= self._cfg.settle_s

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

    # -- moving the limit ----------------------------------------------------

    def _settled(self, sample: Sample) -> bool:
        if self._reached_at is None:
            if sample.in_flight > self._limit:
                return False  # admissions of a higher limit are still draining
            self._reached_at = sample.now
        return sample.now - self._reached_at >= self._cfg.settle_s

    def _ramp(self, now: float) -> int:
        """Move towards the target by ramp_per_s: N permits granted at once would be N
        prefills queued behind each other, a TTFT spike the raise itself caused."""
        allowance = max(1, int(self._cfg.ramp_per_s * self._elapsed))
        self._limit = min(self._target, self._limit + allowance)
        self._raised_at = now
        if self._limit == self._target:
            self._reached_at = now
        return self._limit

    def _raise(self, now: float, to: float) -> int:
        new = self._cfg.clamp(max(self._limit + 1, int(to)))
        if new <= self._limit:
            return self._limit
        self._raised_from = self._limit
        self._target = new
        self._reached_at = None
        return self._ramp(now)

    def _lower(self, now: float, to: float) -> int:
        del now
        new = self._cfg.clamp(min(self._limit - 1, math.ceil(to)))
        self._limit = self._target = new
        self._reached_at = None
        return new

    @property
    def learned(self) -> Solo | None:
        """What a successor should start from on reload: the measured solo."""
        if self.solo is None or not self._solo_measured:
            return None
        return Solo(self.solo, self._solo_c, self._solo_kv)

    def _decrease(self, now: float, target: float) -> int:
        self._decreased_at = self._cut_at = now
        self._measuring_solo = False
        return self._lower(now, max(self._limit * _MAX_CUT, target))
