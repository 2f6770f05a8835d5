"""A backend replica: its config plus the live state that survives reloads."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.settings import BackendConfig
from gateway.window import RollingWindow

log = logging.getLogger("kneecap.health")

UNLIMITED = 1 << 30


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
        """Passive ejection: enough failures in a row take the replica out."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= threshold:
            if self.healthy:  # the active probe says "up" again; this is its "DOWN"
                log.warning(
                    "backend %s is DOWN (%d failed requests in a row)",
                    self.name,
                    self.consecutive_failures,
                )
            self.healthy = False
