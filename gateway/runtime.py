"""The live state of one gateway: the current config snapshot and what outlives it.

Each request reads ``runtime.current`` once and keeps that snapshot to the
end, so a reload (one attribute assignment) never changes a request midway.
Replicas, admission queues and the HTTP client outlive snapshots.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from backends.pool import BackendSet
from backends.replica import EngineGauges, Replica
from gateway.config_file import read_config_file
from gateway.config_warnings import config_warnings
from gateway.control import LimitLoop
from gateway.disconnect import DisconnectWatches
from gateway.metrics import GatewayMetrics
from gateway.recording import Recorder
from gateway.routing import RoutingState
from gateway.settings import ConfigError, Settings, build_settings, load_settings
from gateway.upstream import UpstreamTransport
from policies.admission import PoolAdmission, Priority

log = logging.getLogger("kneecap.runtime")


@dataclass(frozen=True, slots=True)
class Snapshot:
    settings: Settings
    backends: BackendSet
    # Secrets stay out of reprs: a logged traceback or a debugger print shows the snapshot.
    client_keys: tuple[tuple[bytes, str], ...] = field(default=(), repr=False)  # (key, class)
    admin_token: bytes | None = field(default=None, repr=False)
    # Per-request timeouts for the transport; a reload changes them for new requests.
    upstream_timeouts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls, settings: Settings, previous: BackendSet | None, sim_urls: Mapping[str, str]
    ) -> Snapshot:
        admin = settings.auth.admin_token
        upstream = settings.upstream
        return cls(
            settings=settings,
            backends=BackendSet.build(settings.backends, previous, sim_urls),
            client_keys=tuple((k.encode(), p) for k, p in settings.auth.client_keys()),
            admin_token=admin.get_secret_value().encode() if admin else None,
            upstream_timeouts={
                "connect": upstream.connect_timeout_s,
                "read": upstream.read_timeout_s,  # the stall guard between chunks
                "write": upstream.read_timeout_s,
                "pool": upstream.connect_timeout_s,
            },
        )

    def client_priority(self, presented: str | None) -> str | None:
        """The presented key's priority class, or None when it is not accepted."""
        if not self.client_keys:
            return "interactive"
        candidate = (presented or "").encode()
        matched = None
        # Compare against every key so timing does not reveal which one matched.
        for key, priority in self.client_keys:
            if hmac.compare_digest(candidate, key):
                matched = priority
        return matched

    def admin_ok(self, presented: str | None) -> bool:
        if self.admin_token is None:
            return True
        return hmac.compare_digest((presented or "").encode(), self.admin_token)


@dataclass(slots=True)
class ReloadResult:
    ok: bool
    message: str


@dataclass(eq=False)
class Runtime:
    current: Snapshot
    client: httpx.AsyncClient
    transport: UpstreamTransport  # proxied requests go straight here
    recorder: Recorder
    metrics_registry: CollectorRegistry
    config_path: Path | None = None
    sim_urls: dict[str, str] = field(default_factory=dict)
    admissions: dict[str, PoolAdmission] = field(default_factory=dict)
    # Called after a reload so that new replicas are probed now, not a full interval later.
    on_reload: Callable[[], None] = lambda: None
    limits: LimitLoop = field(default_factory=LimitLoop)
    routing: RoutingState = field(default_factory=RoutingState)  # calibration, sessions
    disconnects: DisconnectWatches = field(default_factory=DisconnectWatches)
    # Removed replicas still holding requests, however many reloads ago, several per name
    # when a reload re-addressed a backend: a backend added back at the URL of one before
    # it finishes gets that replica back, in-flight count included, so its limit holds.
    retired: list[Replica] = field(default_factory=list)
    # Removed backends that have drained, with their replicas (none when only series are
    # left). Their series are shown drained by the next exposition, their last requests
    # counted, and go at the exposition after it if nothing was counted on them meanwhile.
    _drained: dict[str, list[Replica]] = field(default_factory=dict)
    # Those the last exposition showed drained, and their requests and retries counted then.
    _shown_drained: dict[str, tuple[list[Replica], float]] = field(default_factory=dict)
    # Rejections per pool as the last exposition showed them: a removed pool's series go
    # once an exposition has shown all that was counted on them.
    _rejections_shown: dict[str, float] = field(default_factory=dict)
    # What the process started with: the keys only a restart applies are compared to it.
    _at_startup: Settings | None = None

    def __post_init__(self) -> None:
        self._at_startup = self.current.settings
        self._sync_admissions()
        self._sync_metrics()
        self._sync_limits()

    def _sync_limits(self) -> None:
        settings = self.current.settings
        self.limits.sync(self.current.backends.replicas, lambda r: settings.limit_of(r.config))

    def control_tick(self) -> None:
        """One round of limit control; queued requests retry when a limit rose, and those
        of any pool still waiting try again each tick: a waiter's chances may change with
        no event in its own pool to say so (a replica ejected by failed requests, which no
        probe announces; a release in the pool it was planned onto or borrows from)."""
        self.recorder.flush()  # the windows the controllers read
        self._drop_removed_pools()  # gone from /admin/state once drained, scraped or not
        now, mono = time.perf_counter(), time.monotonic()
        staleness = self.current.settings.measurement.scrape_staleness_s

        def engine_of(replica: Replica) -> EngineGauges | None:
            return replica.fresh_engine(mono, staleness)  # stale figures mislead

        def demand(replica: Replica) -> int:
            admission = self.admissions.get(replica.pool)
            return admission.depth() if admission else 0

        changed = self.limits.tick(self.current.backends.replicas, now, engine_of, demand)
        for admission in list(self.admissions.values()):
            if changed or admission.depth():
                admission.notify()

    @property
    def metrics(self) -> GatewayMetrics:
        return self.recorder.metrics

    def _sync_metrics(self) -> None:
        """Register series of new backends and pools. A removed backend keeps its series
        while it drains (see :meth:`_forget_drained`); one added back keeps the same."""
        for pool in self.current.settings.pools:
            self.metrics.register_pool(pool, [p.name.lower() for p in Priority])
        for replica in self.current.backends.replicas:
            self._drained.pop(replica.name, None)
            self._shown_drained.pop(replica.name, None)
            self.metrics.register_backend(replica.name, replica.pool)
            replica.window.span_s = self.current.settings.measurement.window_s

    def _forget_drained(self) -> None:
        """Retired replicas whose last request ended leave; a backend no longer configured
        and no longer held by any replica is shown drained by the next exposition."""
        drained = [r for r in self.retired if r.in_flight == 0]
        self.retired = [r for r in self.retired if r.in_flight > 0]
        held = self._held_names()
        for replica in drained:
            if replica.name not in held:
                self._drained.setdefault(replica.name, []).append(replica)

    def _held_names(self) -> set[str]:
        """Backends whose series stay whatever was counted: configured, or still draining."""
        return {r.name for r in (*self.current.backends.replicas, *self.retired)}

    def draining(self) -> list[Replica]:
        """Removed replicas still holding requests, however few."""
        return [r for r in self.retired if r.in_flight > 0]

    def refresh_gauges(self) -> None:
        """Live state → gauges; run before each exposition, so requests pay nothing."""
        self.recorder.flush()
        self._expire_drained()
        self._drop_removed_pools()  # a removed pool whose last request ended goes
        self._expire_removed_pools()
        now, mono = time.perf_counter(), time.monotonic()
        staleness = self.current.settings.measurement.scrape_staleness_s
        for name, replicas in self._replicas_by_name().items():
            live = self.current.backends.get(name)
            in_flight = sum(r.in_flight for r in replicas)
            # Removed, it drains: in flight counts down, no new request goes to it.
            self.metrics.set_backend_state(
                name,
                up=live is not None and live.healthy,
                inflight=in_flight,
                limit=(live or replicas[0]).limit,
            )
            engine = live.fresh_engine(mono, staleness) if live is not None else None
            kv_usage = engine.kv_usage if engine is not None else None
            if engine is not None and engine.running is not None:
                running, waiting = engine.running, engine.waiting or 0.0
            else:  # no engine figures: the gateway's own count stands in
                running, waiting = in_flight, 0.0
            self.metrics.set_engine_stats(
                name, running=running, waiting=waiting, kv_cache_usage=kv_usage
            )
            tokens_per_s = sum(r.window.output_tokens_per_s(now) for r in replicas)
            self.metrics.set_output_tokens_per_second(name, tokens_per_s)
        for pool, admission in self.admissions.items():
            for priority in Priority:
                self.metrics.set_queue_depth(pool, priority.name.lower(), admission.depth(priority))

    def _expire_drained(self) -> None:
        """Series the last exposition showed drained go, unless something was counted on
        them since (a request that failed over from the backend and then ended, a retry
        from it that went out): those are shown once more, as are those drained since."""
        self._forget_drained()
        held = self._held_names()
        shown = {n: v for n, v in self._shown_drained.items() if n not in held}
        counted = self.metrics.counted(shown)
        for name, (replicas, before) in shown.items():
            if counted[name] == before:
                self.metrics.remove_backend(name)
            else:
                self._drained.setdefault(name, replicas)
        for name in self.metrics.backends() - held - self._drained.keys():
            # Counted after its series went (such a request or retry): shown once, then
            # gone like the others.
            self._drained[name] = []
        counted = self.metrics.counted(self._drained)
        self._shown_drained = {n: (r, counted[n]) for n, r in self._drained.items()}
        self._drained = {}

    def _replicas_by_name(self) -> dict[str, list[Replica]]:
        """The replicas behind each backend's series: its live one, and those still draining
        where reloads re-addressed it (all count in its in-flight gauge)."""
        group = {r.name: [r] for r in self.current.backends.replicas}
        for replica in self.retired:
            group.setdefault(replica.name, []).append(replica)
        for name, (drained, _) in self._shown_drained.items():
            if drained:  # a name with series but no replica has no gauge left to set
                group.setdefault(name, []).extend(drained)
        return group

    def admission(self, pool: str) -> PoolAdmission:
        return self.admissions[pool]

    def _sync_admissions(self) -> None:
        self._drop_removed_pools()
        for name, pool in self.current.settings.pools.items():
            existing = self.admissions.get(name)
            if existing is None:
                self.admissions[name] = PoolAdmission(
                    max_queue_depth=pool.max_queue_depth, batch_share=pool.batch_share, name=name
                )
            else:
                existing.configure(
                    max_queue_depth=pool.max_queue_depth, batch_share=pool.batch_share
                )

    def _drop_removed_pools(self) -> None:
        """A removed pool's queue is served (or refused) by the notify that follows a
        reload; the pool goes once nothing waits in it and no lease of it is held. Its
        series stay until an exposition has shown them (:meth:`_expire_removed_pools`)."""
        pools = self.current.settings.pools
        for name in [n for n in self.admissions if n not in pools]:
            admission = self.admissions[name]
            if admission.depth() == 0 and admission.leased == 0:
                admission.close()
                del self.admissions[name]

    def _expire_removed_pools(self) -> None:
        """Series of a pool no longer configured and whose queue is gone: they go once an
        exposition has shown every rejection counted on them (at once, when the last one
        did); until then they are shown with an empty queue. Run before each exposition."""
        counted = self.metrics.rejections()
        for pool in counted.keys() - self.current.settings.pools.keys() - self.admissions.keys():
            priorities = [p.name.lower() for p in Priority]
            if counted[pool] == self._rejections_shown.get(pool, 0.0):
                self.metrics.remove_pool(pool, priorities)
                del counted[pool]
            else:  # counted since: refused waiters of its last queue, a late refusal
                for priority in priorities:
                    self.metrics.set_queue_depth(pool, priority, 0)
        self._rejections_shown = counted

    def notify(self, replica: Replica | None = None) -> None:
        """Capacity may have changed: queued requests try again. A replica's own pool
        first, then the others: their waiters may borrow from it, or, their own pool having
        lost its replicas, be planned onto or away from it."""
        first = self.admissions.get(replica.pool) if replica is not None else None
        if first is not None:
            first.notify()
        for admission in list(self.admissions.values()):
            if admission is not first:
                admission.notify()

    def apply(self, settings: Settings) -> ReloadResult:
        unknown_sims = [
            b.name for b in settings.backends if b.url is None and b.name not in self.sim_urls
        ]
        if unknown_sims:
            message = "simulated backends can only be added at startup: " + ", ".join(unknown_sims)
            return ReloadResult(False, message)
        # Everything read from the settings alone comes before the swap: a check that
        # raised after it would leave the new config live yet reported as failed.
        warnings = config_warnings(settings)
        unapplied = _needing_a_restart(self._at_startup or settings, settings)
        held = [*self.retired, *self.current.backends.replicas]
        self.current = Snapshot.build(settings, self._keepable(settings, held), self.sim_urls)
        live = set(map(id, self.current.backends.replicas))
        self.retired = [r for r in held if id(r) not in live]
        self._sync_admissions()
        self._sync_metrics()
        self._forget_drained()
        self._sync_limits()
        self.notify()
        self.on_reload()
        names = ", ".join(r.name for r in self.current.backends.replicas)
        message = f"config applied: {len(self.current.backends.replicas)} backends ({names})"
        for warning in warnings:
            log.warning("config reload: %s", warning)
        if unapplied:
            log.warning("config reload: %s take effect only at a restart", ", ".join(unapplied))
            message += f"; not applied until a restart: {', '.join(unapplied)}"
        return ReloadResult(True, message)

    def _keepable(self, settings: Settings, held: list[Replica]) -> BackendSet:
        """Per backend of ``settings``, the replica it keeps: the one, live or draining, at
        the URL it names (resolved as :meth:`BackendSet.build` does); none there, that of a
        backend this reload renames, the only live one at that URL whose name goes, when it
        is the only newcomer there (a new replica beside it would let the engine run the
        old name's requests and the new name's whole limit); else a new one. Where a live
        and a draining replica share name and URL, the live one (last) wins."""
        urls = {
            b.name: (b.url or self.sim_urls.get(b.name, "")).rstrip("/") for b in settings.backends
        }
        kept = {r.name: r for r in held if urls.get(r.name) == r.url}
        going: dict[str, list[Replica]] = {}
        for replica in self.current.backends.replicas:
            if replica.name not in urls:
                going.setdefault(replica.url, []).append(replica)
        coming: dict[str, list[str]] = {}
        for name, url in urls.items():
            if name not in kept:
                coming.setdefault(url, []).append(name)
        for url, names in coming.items():
            old = going.get(url, [])
            if len(names) == 1 and len(old) == 1:  # more: which is which is a guess
                renamed = kept[names[0]] = old[0]
                # To its probes a new name is a new backend: it waits for a first verdict
                # (requests meanwhile wait with it), while its requests in flight, on the
                # same engine, still count against its limit.
                renamed.healthy = renamed.probed = False
                renamed.ejected_until = None  # else its probes, ignored while held, never come
        return BackendSet.named(kept)

    def reload(self) -> ReloadResult:
        """Re-read the config file; on any error the old config keeps serving."""
        try:
            settings = self._read_config()
        except ConfigError as exc:
            log.error("config reload rejected, keeping the old config: %s", exc)
            self.metrics.observe_config_reload(False)
            return ReloadResult(False, str(exc))
        except Exception as exc:  # a config the checks above missed must not take us down
            log.exception("config reload failed, keeping the old config")
            self.metrics.observe_config_reload(False)
            return ReloadResult(False, f"config could not be read: {type(exc).__name__}: {exc}")
        result = self.apply(settings)
        self.metrics.observe_config_reload(result.ok)
        (log.info if result.ok else log.error)("config reload: %s", result.message)
        return result

    def _read_config(self) -> Settings:
        """The file as a reload reads it. A file written in place can be read empty or half
        written: empty, it is refused (a running gateway losing every backend to a
        truncation is never what was meant; ``backends: []`` says it on purpose), and one
        silent on ``watch_config`` leaves the watcher as it is, so that what the writer
        finishes is still applied: only ``watch_config: false`` turns the watcher off."""
        if self.config_path is None:
            return load_settings(None)
        data = read_config_file(self.config_path, allow_empty=False)
        if "watch_config" not in data:
            data = {**data, "watch_config": self.current.settings.watch_config}
        return build_settings(data)


def _needing_a_restart(running: Settings, new: Settings) -> list[str]:
    """Keys a reload changed that are read only at startup: the listening socket, the
    shutdown drain, and the simulators ``kneecap serve`` started itself."""
    changed = [
        f"listen.{key}"
        for key in ("host", "port", "drain_timeout_s")
        if getattr(running.listen, key) != getattr(new.listen, key)
    ]
    old_sims = {b.name: b for b in running.backends if b.sim is not None}
    for b in new.backends:
        old = old_sims.get(b.name)
        if b.sim is None or old is None:
            continue
        # The simulator serves the model it was started with: a new name would reach
        # the gateway's listing but not the engine.
        changed += [
            f"backends.{b.name}.{key}"
            for key in ("sim", "models", "engine")
            if getattr(old, key) != getattr(b, key)
        ]
    return changed
