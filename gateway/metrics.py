"""Every Prometheus metric kneecap exports, against an injected registry.

Nothing here touches prometheus_client's default registry: ``create_app`` builds a
``CollectorRegistry``, hands it to :class:`GatewayMetrics`, and ``GET /metrics``
renders that registry with :func:`render`.

Cost model. The request path calls :meth:`GatewayMetrics.observe_request` once
per request, after the stream ended; labelled children are cached per label set
because ``labels()`` costs about as much as an observation. ITL has one value per
output token, so it goes to :class:`gateway.histogram.BulkHistogram`, which takes
a whole request's gaps in one call. Gauges describing live state (in flight, limit, up,
engine figures, windowed tokens/s) are meant to be set from that state when
``/metrics`` is scraped, so requests pay nothing for them.

Label choices. Request histograms and counters carry (backend, pool, model), the
queue-wait histogram included: it is observed for admitted requests only, when
the backend is known; requests that never got one are counted in
``kneecap_rejected_requests_total{pool, reason}``. Gauges of a backend carry
(backend, pool) so panels can group by pool; engine gauges carry backend only,
since they restate the engine's own figures. Ejections carry (backend, reason);
``backends/`` code, which imports no metrics, reports them through the callback
the health prober installs (:meth:`GatewayMetrics.observe_ejection`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from backends.replica import EJECTION_REASONS, EjectionReason
from gateway.histogram import BulkHistogram
from gateway.record import REJECT_REASONS, RejectReason, RequestRecord

# Latency buckets resolve 10 ms to 120 s (TTFT, queue wait); the 1-5 ms ones show
# the gateway's own queueing overhead, which should sit in the first bucket.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
)  # fmt: skip
# Whole generations can outlast two minutes.
E2E_BUCKETS: tuple[float, ...] = (*LATENCY_BUCKETS[3:], 180.0, 300.0, 600.0)
# ITL is typically 5-50 ms and its knee shows as a few ms of drift: fine steps there.
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03,
    0.035, 0.04, 0.05, 0.065, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# The gateway's own time before a backend has the request: sub-millisecond when all is
# well, milliseconds when it connects afresh or its event loop is saturated.
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
    0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

_REQ = ("backend", "pool", "model")
_BACKEND = ("backend", "pool")
_SeriesKey = tuple[str, str, str]


@dataclass(slots=True)
class _Series:
    """Cached children of the per-request metrics for one (backend, pool, model)."""

    ttft: Histogram
    e2e: Histogram
    queue: Histogram
    overhead: Histogram
    prompt: Counter
    completion: Counter


def _hist(r: CollectorRegistry, name: str, doc: str, b: Sequence[float]) -> Histogram:
    return Histogram(name, doc, _REQ, registry=r, buckets=b)


def _counter(r: CollectorRegistry, name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, labels, registry=r)


def _gauge(r: CollectorRegistry, name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, labels, registry=r)


class GatewayMetrics:
    """The gateway's metrics, all registered on ``registry`` at construction."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ttft = _hist(
            r,
            "kneecap_request_ttft_seconds",
            "Receipt to first output event relayed (streams).",
            LATENCY_BUCKETS,
        )
        self.itl = BulkHistogram(
            "kneecap_request_itl_seconds", "Gap per output token as relayed.", _REQ, ITL_BUCKETS
        )
        r.register(self.itl)
        self.e2e = _hist(
            r, "kneecap_request_e2e_seconds", "Receipt to end of response.", E2E_BUCKETS
        )
        self.queue = _hist(
            r,
            "kneecap_request_queue_seconds",
            "Time spent waiting for admission, summed over a retried request's attempts.",
            LATENCY_BUCKETS,
        )
        self.overhead = _hist(
            r,
            "kneecap_request_overhead_seconds",
            "Receipt to the request written upstream, less queue waits and failed attempts: "
            "the gateway's own time (reading, routing, connecting) before the backend has it.",
            OVERHEAD_BUCKETS,
        )
        self.requests = _counter(
            r, "kneecap_requests", "Requests that reached a backend, by outcome.", *_REQ, "status"
        )
        self.prompt_tokens = _counter(
            r, "kneecap_prompt_tokens", "Prompt tokens per backend usage.", *_REQ
        )
        self.completion_tokens = _counter(
            r, "kneecap_completion_tokens", "Output tokens per backend usage.", *_REQ
        )
        self.inflight = _gauge(r, "kneecap_inflight_requests", "Admitted, not finished.", *_BACKEND)
        self.limit = _gauge(r, "kneecap_concurrency_limit", "Current admission limit.", *_BACKEND)
        self.backend_up = _gauge(
            r,
            "kneecap_backend_up",
            "1 while health checks pass; 0 while a backend a reload removed drains.",
            *_BACKEND,
        )
        self.queue_depth = _gauge(
            r, "kneecap_queue_depth", "Requests waiting for admission.", "pool", "priority"
        )
        self.rejected = _counter(
            r, "kneecap_rejected_requests", "Refused before reaching a backend.", "pool", "reason"
        )
        self.engine_running = _gauge(
            r, "kneecap_engine_requests_running", "Engine's running requests.", "backend"
        )
        self.engine_waiting = _gauge(
            r, "kneecap_engine_requests_waiting", "Engine's waiting requests.", "backend"
        )
        self.engine_kv_usage = _gauge(
            r, "kneecap_engine_kv_cache_usage_ratio", "Engine's KV-cache usage, 0-1.", "backend"
        )
        self.output_tps = _gauge(
            r,
            "kneecap_output_tokens_per_second",
            "Output tokens/s over the rolling window.",
            "backend",
        )
        self.config_reloads = _counter(
            r, "kneecap_config_reloads", "Config reloads by result.", "result"
        )
        self.retries = _counter(
            r, "kneecap_upstream_retries", "Attempts retried on another backend.", "backend"
        )
        self.ejections = _counter(
            r,
            "kneecap_backend_ejections",
            "Times a backend in rotation was taken out: failed_requests (passive ejection), "
            "probe_failed (its health probe failed).",
            "backend",
            "reason",
        )
        for result in ("ok", "error"):
            self.config_reloads.labels(result)
        self._per_request: tuple[Histogram | Counter, ...] = (
            self.ttft, self.e2e, self.queue, self.overhead, self.prompt_tokens,
            self.completion_tokens,
        )  # fmt: skip
        self._per_backend: tuple[Counter | Gauge, ...] = (
            self.engine_running, self.engine_waiting, self.engine_kv_usage, self.output_tps,
            self.retries,
        )  # fmt: skip
        self._series: dict[_SeriesKey, _Series] = {}
        self._status: dict[tuple[str, str, str, str], Counter] = {}
        self._backend_pool: dict[str, str] = {}
        self._retries: dict[str, Counter] = {}
        self._ejections: dict[tuple[str, EjectionReason], Counter] = {}

    # -- request path: once per request ---------------------------------------

    def observe_request(self, record: RequestRecord) -> None:
        key = (record.backend, record.pool, record.model)
        series = self._series.get(key) or self._new_series(key)
        series.queue.observe(record.queue_s)
        if record.overhead_s is not None:
            series.overhead.observe(record.overhead_s)
        series.e2e.observe(record.e2e_s)
        if record.ttft_s is not None:
            series.ttft.observe(record.ttft_s)
        if record.itl_s:
            self.itl.observe_many(key, record.itl_s)
        if record.prompt_tokens:
            series.prompt.inc(record.prompt_tokens)
        if record.completion_tokens:
            series.completion.inc(record.completion_tokens)
        status_key = (*key, record.status)
        status = self._status.get(status_key)
        if status is None:
            status = self._status[status_key] = self.requests.labels(*status_key)
        status.inc()

    def observe_rejection(self, pool: str, reason: RejectReason) -> None:
        self.rejected.labels(pool, reason).inc()

    def observe_retry(self, backend: str) -> None:
        retries = self._retries.get(backend)
        if retries is None:
            retries = self._retries[backend] = self.retries.labels(backend)
        retries.inc()

    def observe_ejection(self, backend: str, reason: EjectionReason) -> None:
        """A backend in rotation was taken out. Counted only while the backend has series:
        a late report on one whose series :meth:`remove_backend` dropped brings none back."""
        ejections = self._ejections.get((backend, reason))
        if ejections is not None:
            ejections.inc()

    def observe_config_reload(self, ok: bool) -> None:
        self.config_reloads.labels("ok" if ok else "error").inc()

    # -- live state: set at scrape time or on change ---------------------------

    def set_backend_state(self, backend: str, *, up: bool, inflight: int, limit: float) -> None:
        pool = self._backend_pool[backend]  # KeyError: register_backend() was not called
        self.backend_up.labels(backend, pool).set(1 if up else 0)
        self.inflight.labels(backend, pool).set(inflight)
        self.limit.labels(backend, pool).set(limit)

    def set_engine_stats(
        self, backend: str, *, running: float, waiting: float, kv_cache_usage: float | None
    ) -> None:
        """Engine figures; when the engine has no fresh /metrics, pass the gateway's own
        counts. The gateway has no stand-in for KV-cache usage: without a fresh figure
        the series goes (Prometheus sees it absent) until the engine reports again."""
        self.engine_running.labels(backend).set(running)
        self.engine_waiting.labels(backend).set(waiting)
        if kv_cache_usage is None:
            _remove_if_present(self.engine_kv_usage, backend)
        else:
            self.engine_kv_usage.labels(backend).set(kv_cache_usage)

    def set_output_tokens_per_second(self, backend: str, value: float) -> None:
        self.output_tps.labels(backend).set(value)

    def set_queue_depth(self, pool: str, priority: str, depth: int) -> None:
        self.queue_depth.labels(pool, priority).set(depth)

    # -- topology: on startup and config reload --------------------------------

    def register_pool(self, pool: str, priorities: Iterable[str]) -> None:
        """Create the pool's series at zero so its panels show 0, not "no data"."""
        for priority in priorities:
            self.queue_depth.labels(pool, priority).set(0)
        for reason in REJECT_REASONS:
            self.rejected.labels(pool, reason)

    def remove_pool(self, pool: str, priorities: Iterable[str]) -> None:
        """Drop the series of a pool that left the configuration."""
        for priority in priorities:
            _remove_if_present(self.queue_depth, pool, priority)
        for reason in REJECT_REASONS:
            _remove_if_present(self.rejected, pool, reason)

    def register_backend(self, backend: str, pool: str) -> None:
        old_pool = self._backend_pool.get(backend, pool)
        if old_pool != pool:
            # Moved: its gauges carry its pool and move with it. Its request series carry
            # the pool each request was routed to, which the move does not change: they
            # stay, and the requests still in flight there are counted in them.
            for gauge in (self.backend_up, self.inflight, self.limit):
                _remove_if_present(gauge, backend, old_pool)
        self._backend_pool[backend] = pool
        self.backend_up.labels(backend, pool).set(0)
        self.inflight.labels(backend, pool).set(0)
        self._retries.setdefault(backend, self.retries.labels(backend))
        for reason in EJECTION_REASONS:  # at 0: increase() sees the first ejection
            if (backend, reason) not in self._ejections:
                self._ejections[backend, reason] = self.ejections.labels(backend, reason)

    def remove_backend(self, backend: str) -> None:
        """Drop every label set of a backend that left the configuration."""
        for key in [k for k in self._series if k[0] == backend]:
            del self._series[key]
            for per_request in self._per_request:
                per_request.remove(*key)
        self.itl.remove_where(lambda k: k[0] == backend)
        for status_key in [k for k in self._status if k[0] == backend]:
            del self._status[status_key]
            self.requests.remove(*status_key)
        pool = self._backend_pool.pop(backend, None)
        if pool is not None:
            for gauge in (self.backend_up, self.inflight, self.limit):
                _remove_if_present(gauge, backend, pool)
        self._retries.pop(backend, None)
        for reason in EJECTION_REASONS:
            if self._ejections.pop((backend, reason), None) is not None:
                self.ejections.remove(backend, reason)
        for metric in self._per_backend:
            _remove_if_present(metric, backend)

    def backends(self) -> set[str]:
        """Every backend that some series is labelled with. The engine gauges and tokens/s
        are set at scrape time for known backends only, so they add none."""
        return {
            *self._backend_pool,
            *(k[0] for k in self._series),
            *(k[0] for k in self._status),
            *self._retries,
            *(backend for backend, _ in self._ejections),
        }

    def counted(self, backends: Iterable[str]) -> dict[str, float]:
        """Requests and retries counted so far on each of ``backends``. Read at scrape time
        for backends that drained, so requests pay nothing for it; it only grows, so a
        change means something was counted in between."""
        tally = dict.fromkeys(backends, 0.0)
        if not tally:
            return tally
        for metric in (self.requests, self.retries):
            for family in metric.collect():
                for sample in family.samples:
                    backend = sample.labels["backend"]
                    if backend in tally and sample.name.endswith("_total"):
                        tally[backend] += sample.value
        return tally

    def rejections(self) -> dict[str, float]:
        """Rejections counted so far per pool, for every pool with series. Read at scrape
        time, so requests pay nothing for it; it only grows while the pool's series live."""
        tally: dict[str, float] = {}
        for family in self.rejected.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    pool = sample.labels["pool"]
                    tally[pool] = tally.get(pool, 0.0) + sample.value
        return tally

    def _new_series(self, key: _SeriesKey) -> _Series:
        series = _Series(
            ttft=self.ttft.labels(*key),
            e2e=self.e2e.labels(*key),
            queue=self.queue.labels(*key),
            overhead=self.overhead.labels(*key),
            prompt=self.prompt_tokens.labels(*key),
            completion=self.completion_tokens.labels(*key),
        )
        self._series[key] = series
        return series


def _remove_if_present(metric: Counter | Gauge, *labelvalues: str) -> None:
    # Older prometheus_client raises KeyError for a label set it never saw.
    with contextlib.suppress(KeyError):
        metric.remove(*labelvalues)


def render(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for: (body, content type). An Accept
    prometheus_client cannot read gets the text format, which every scraper reads: a
    client's header must not fail the scrape."""
    try:
        encoder, content_type = choose_encoder(accept or "")
    except Exception:  # 0.26 compares a version such as "abc" with ints: a TypeError
        encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    return encoder(registry), content_type
