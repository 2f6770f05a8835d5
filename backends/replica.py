"""A backend replica: its config plus the live state that survives reloads."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from gateway.settings import BackendConfig, HealthConfig
from gateway.window import RollingWindow

log = logging.getLogger("kneecap.health")

UNLIMITED = 1 << 30

# Why a backend in rotation was taken out: its requests failed (passive ejection, here), or
# its health probe did (backends/health.py).
EjectionReason = Literal["failed_requests", "probe_failed"]
EJECTION_REASONS: tuple[EjectionReason, ...] = get_args(EjectionReason)
# Told the backend's name and why, at each ejection: the gateway counts them in its metrics,
# which backends/ code does not import.
OnEjection = Callable[[str, EjectionReason], None]


def uncounted(backend: str, reason: EjectionReason) -> None:
    """An :data:`OnEjection` for a rotation no gateway counts (one driven on its own)."""


# The meters' clock (gateway/recording.py): a window's times are on it.
_meters_now = time.perf_counter


@dataclass(slots=True)
class EngineGauges:
    """What the engine's own /metrics said at ``scraped_at`` (monotonic)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    scraped_at: float | None = None


@dataclass(eq=False, slots=True)
class Replica:
    config: BackendConfig
    url: str
    in_flight: int = 0
    limit: int = UNLIMITED
    healthy: bool = False  # unknown until the first probe answers
    probed: bool = False  # a probe has answered (or failed): False only for a new replica
    consecutive_failures: int = 0
    discovered_models: frozenset[str] = frozenset()
    engine: EngineGauges = field(default_factory=EngineGauges)
    # Created now, on the meters' clock: a window that took its age from its first sample
    # divided a fresh backend's first answer by a few milliseconds (9,088 tokens/s for one
    # of 500 tokens that took 2 s).
    window: RollingWindow = field(default_factory=lambda: RollingWindow(created=_meters_now()))
    # Prompt + max output tokens of the requests in flight (admission in tokens).
    tokens_in_flight: int = 0
    discovered_max_model_len: int | None = None  # from /v1/models or /tokenize
    kv_capacity_tokens: int | None = None  # KV cache size the engine's /metrics reported
    # The engine's own entries of its /v1/models, by model id: the gateway's listing
    # passes them on (owner, creation time, root, context length) rather than inventing.
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Passive ejection: held out until then (the rotation's clock), whatever its probes
    # say; None when not. Its ejections in a row, and when it was last readmitted, from
    # which they decay.
    ejected_until: float | None = None
    ejection_reason: str = ""
    ejections: int = 0
    readmitted_at: float = 0.0
    # Its pool as the health prober last installed it: None until the first probe round.
    rotation: Rotation | None = None

    @property
    def max_model_len(self) -> int | None:
        """The context length: configured, else discovered, else unknown (None)."""
        configured = self.config.max_model_len
        return configured if configured is not None else self.discovered_max_model_len

    def learn_models(self, listing: Mapping[str, Any]) -> None:
        """Digest the backend's ``/v1/models``: served models and context length."""
        # The backend's answer is untrusted: any other shape is a failed probe.
        data = listing.get("data", ()) if isinstance(listing, Mapping) else None
        if not isinstance(data, list | tuple):
            raise ValueError(f"/v1/models is not an OpenAI model list: {type(listing).__name__}")
        cards = [c for c in data if isinstance(c, Mapping)]
        if not self.config.models:
            self.discovered_models = frozenset(c["id"] for c in cards)
        self.model_cards = {c["id"]: dict(c) for c in cards if isinstance(c.get("id"), str)}
        lengths = [c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)]
        if lengths:
            self.discovered_max_model_len = min(lengths)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def pool(self) -> str:
        return self.config.pool

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.config.models) if self.config.models else self.discovered_models

    def serves(self, model: str) -> bool:
        """``model in self.models``, without building a set: asked on every request."""
        configured = self.config.models
        return model in configured if configured else model in self.discovered_models

    def fresh_engine(self, now: float, staleness_s: float) -> EngineGauges | None:
        """The engine's own figures, unless missing or older than ``staleness_s``."""
        scraped = self.engine.scraped_at
        if scraped is None or now - scraped > staleness_s:
            return None
        return self.engine

    @property
    def has_room(self) -> bool:
        return self.healthy and self.in_flight < self.limit

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, threshold: int) -> None:
        """Passive ejection: ``threshold`` failures in a row take the replica out, unless
        its pool may not lose it (:meth:`Rotation.refusal`). Runs only on a failure."""
        self.consecutive_failures += 1
        rotation = self.rotation
        if self.consecutive_failures < threshold or not self.healthy or rotation is None:
            return
        refusal = rotation.refusal(self)
        if refusal is not None:
            if self.consecutive_failures == threshold:  # once a run, not at every failure
                log.warning(
                    "backend %s failed %d requests in a row but stays in rotation: %s",
                    self.name,
                    self.consecutive_failures,
                    refusal,
                )
            return
        now, config = rotation.clock(), rotation.config
        self.ejections = ejections_in_a_row(self.ejections, now - self.readmitted_at, config)
        held_s = ejection_time(self.ejections, config)
        self.ejected_until = now + held_s
        self.ejection_reason = f"{self.consecutive_failures} failed requests in a row"
        self.healthy = False  # the active probe says "up" again; this is its "DOWN"
        rotation.on_ejection(self.name, "failed_requests")
        log.warning(
            "backend %s is DOWN (%s): ejected for %g s (ejection %d in a row)",
            self.name,
            self.ejection_reason,
            held_s,
            self.ejections,
        )

    def held_out(self, now: float) -> bool:
        """Its passive ejection still runs: a probe that answers does not readmit it."""
        return self.ejected_until is not None and now < self.ejected_until

    def readmitted(self, now: float) -> None:
        """Back in rotation: failures count afresh, its ejections decay from now."""
        self.ejected_until = None
        self.consecutive_failures = 0
        self.readmitted_at = now

    def ejection_view(self, now: float) -> dict[str, Any] | None:
        """For ``/admin/state``: why it is held out and how much longer, ``now`` on the
        rotation's clock (monotonic). 0 s left: the next successful probe readmits it."""
        if self.ejected_until is None:
            return None
        return {
            "reason": self.ejection_reason,
            "ejections_in_a_row": self.ejections,
            "remaining_s": round(max(0.0, self.ejected_until - now), 3),
        }


def ejection_time(ejections: int, config: HealthConfig) -> float:
    """How long the ``ejections``-th ejection in a row holds a backend out."""
    return min(config.ejection_s * ejections, config.max_ejection_s)


def ejections_in_a_row(previous: int, in_rotation_s: float, config: HealthConfig) -> int:
    """The count an ejection makes: one more than before, less one for each ``ejection_s``
    spent back in rotation since (a backend that held up as long as it was out starts
    over), and no more than reaches ``max_ejection_s``: past that a higher count would
    only take longer to decay."""
    decayed = max(0, previous - int(in_rotation_s // config.ejection_s))
    return min(decayed + 1, math.ceil(config.max_ejection_s / config.ejection_s))


@dataclass(frozen=True, slots=True, eq=False)
class Rotation:
    """One pool's replicas, the ejection knobs and whom to tell of an ejection, shared by
    those replicas, so that a failure decides an ejection where it is counted, with nothing
    to look up. The health prober installs it at each round and at once on a reload
    (:func:`install_rotations`)."""

    replicas: tuple[Replica, ...]
    config: HealthConfig
    clock: Callable[[], float] = time.monotonic
    on_ejection: OnEjection = uncounted

    def refusal(self, replica: Replica) -> str | None:
        """Why ``replica`` may not be ejected now, or None when it may (Envoy's
        max_ejection_percent, and the panic threshold's point: ejecting the last replica
        helps no request, and a client whose requests fail everywhere would empty the
        pool)."""
        for model in sorted(replica.models):
            if not any(r is not replica and r.healthy and r.serves(model) for r in self.replicas):
                return f"the last backend in rotation for {model} in pool {replica.pool}"
        held = sum(r.ejected_until is not None for r in self.replicas)
        allowed = len(self.replicas) * self.config.max_ejection_percent // 100
        if held >= allowed:
            return (
                f"{held} of the {len(self.replicas)} backends of pool {replica.pool} are "
                f"ejected already, as many as health.max_ejection_percent "
                f"({self.config.max_ejection_percent}) allows"
            )
        return None


def install_rotations(
    replicas: tuple[Replica, ...],
    config: HealthConfig,
    clock: Callable[[], float] = time.monotonic,
    on_ejection: OnEjection = uncounted,
) -> None:
    """Give each replica its pool's :class:`Rotation`; one whose pool and knobs are
    unchanged keeps its own, so a probe round builds nothing."""
    pools: dict[str, list[Replica]] = {}
    for replica in replicas:
        pools.setdefault(replica.pool, []).append(replica)
    for members in pools.values():
        current = members[0].rotation
        pool = tuple(members)
        if (
            current is not None
            and current.replicas == pool
            and current.config == config
            and current.clock is clock
            and current.on_ejection == on_ejection  # a bound method is new at each access
            and all(r.rotation is current for r in pool)
        ):
            continue
        rotation = Rotation(pool, config, clock, on_ejection)
        for replica in pool:
            replica.rotation = rotation
