"""The set of replicas one config snapshot routes over, rebuilt on reload.

A rebuilt set reuses the :class:`Replica` of every backend whose name and URL
are unchanged (or that a reload renamed at the same URL, see
:meth:`Runtime._keepable <gateway.runtime.Runtime._keepable>`), so health,
in-flight counts and limits survive a reload; a removed replica simply stops
receiving new requests and drains.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.replica import Replica
from gateway.settings import BackendConfig


@dataclass(frozen=True, slots=True)
class BackendSet:
    replicas: tuple[Replica, ...] = ()
    _by_name: dict[str, Replica] = field(default_factory=dict, repr=False)
    # Asked several times per request; a set's replicas and their pools never change.
    _by_pool: dict[str, tuple[Replica, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for pool in dict.fromkeys(r.pool for r in self.replicas):  # in config order
            self._by_pool[pool] = tuple(r for r in self.replicas if r.pool == pool)

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> BackendSet:
        replicas = tuple(replicas)
        return cls(replicas, {r.name: r for r in replicas})

    @classmethod
    def named(cls, replicas: Mapping[str, Replica]) -> BackendSet:
        """Replicas under the names of the backends that keep them, for :meth:`build`: a
        renamed backend's under its new name."""
        return cls(tuple(replicas.values()), dict(replicas))

    @classmethod
    def build(
        cls,
        configs: Iterable[BackendConfig],
        previous: BackendSet | None = None,
        resolved_urls: Mapping[str, str] | None = None,
    ) -> BackendSet:
        old = previous._by_name if previous else {}
        urls = resolved_urls or {}
        replicas = []
        for config in configs:
            url = (config.url or urls.get(config.name, "")).rstrip("/")
            kept = old.get(config.name)
            if kept is not None and kept.url == url:
                if kept.config.models and not config.models:
                    # Its `models` dropped: what it was told it serves stands until its
                    # probe (at once after a reload) lists the engine's own; what it had
                    # discovered before it was told is stale, and none left it none.
                    kept.discovered_models = frozenset(kept.config.models)
                kept.config = config
                replicas.append(kept)
            else:
                replicas.append(Replica(config=config, url=url))
        return cls.of(replicas)

    def get(self, name: str) -> Replica | None:
        return self._by_name.get(name)

    def in_pool(self, pool: str) -> tuple[Replica, ...]:
        return self._by_pool.get(pool, ())

    def serving(self, model: str) -> list[Replica]:
        return [r for r in self.replicas if r.serves(model)]

    def healthy_models(self) -> list[str]:
        return sorted({m for r in self.replicas if r.healthy for m in r.models})

    def model_listing(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the models a healthy replica serves: the first such
        replica's own entry where it listed one, and as ``max_model_len`` the largest
        context among them, the longest prompt the gateway can route to."""
        listing = []
        for model in self.healthy_models():
            replicas = [r for r in self.replicas if r.healthy and r.serves(model)]
            card = next((r.model_cards[model] for r in replicas if model in r.model_cards), None)
            entry = dict(card) if card else {"id": model, "object": "model", "created": 0}
            entry.setdefault("owned_by", "kneecap")
            lengths = [r.max_model_len for r in replicas if r.max_model_len is not None]
            if lengths:
                entry["max_model_len"] = max(lengths)
            listing.append(entry)
        return listing

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)
