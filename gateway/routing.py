"""The gateway's side of routing: live replicas → pure policies, and what outlives requests.

The policies (``policies.routing`` and neighbours) read :class:`Load` values;
this module builds them from :class:`Replica` state (counts, limits, the
engine's freshly scraped gauges, the token budget) and keeps the state that
outlives requests and reloads: the per-model calibration of the estimator,
loaded tokenizers, session affinity, and each pool's router.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from functools import cache
from typing import Any

from backends.replica import Replica
from gateway.settings import RoutingConfig, Settings
from gateway.tokens import CharsPerToken, ChatTemplate, Estimate, TokenizerFiles
from policies.affinity import SessionTable, Sticky
from policies.prompt_size import PromptShape
from policies.routers import build_router
from policies.routing import Load, Router
from policies.token_budget import token_budget


@cache
def _profile_kv_tokens(profile: str) -> int:
    from backends.sim.profiles import get_profile

    return get_profile(profile).kv_tokens


def kv_capacity(replica: Replica) -> int | None:
    """KV cache tokens, when known: as the engine reports it, or a simulated profile's."""
    if replica.kv_capacity_tokens is not None:
        return replica.kv_capacity_tokens
    sim = replica.config.sim
    if sim is not None and sim.profile is not None:
        return _profile_kv_tokens(sim.profile)
    return None


def token_limit_of(replica: Replica, config: RoutingConfig) -> int | None:
    budget = config.token_budget
    if not budget.enabled:
        return None
    return token_budget(
        configured=replica.config.max_tokens_in_flight,
        kv_capacity=kv_capacity(replica),
        kv_fraction=budget.kv_fraction,
        default=budget.default_max_tokens_in_flight,
    )


def load_of(replica: Replica, settings: Settings, mono: float, sequences: int = 1) -> Load:
    """The replica as a router sees it, for a request of ``sequences`` sequences: each
    holds at most the replica's context, which caps the request's tokens there."""
    engine = replica.fresh_engine(mono, settings.measurement.scrape_staleness_s)
    context = replica.max_model_len
    return Load(
        name=replica.name,
        in_flight=replica.in_flight,
        limit=replica.limit,
        tokens_in_flight=replica.tokens_in_flight,
        token_limit=token_limit_of(replica, settings.routing),
        waiting=None if engine is None else engine.waiting,
        kv_usage=None if engine is None else engine.kv_usage,
        cost_cap=None if context is None else sequences * context,
    )


def session_of(
    headers: Mapping[str, str], payload: Mapping[str, Any], config: RoutingConfig
) -> str | None:
    affinity = config.affinity
    if not affinity.enabled:
        return None
    session = headers.get(affinity.header.lower())  # the names come in lower case
    if session:
        return session
    user = payload.get("user")
    if affinity.use_user_field and isinstance(user, str) and user:
        return "user:" + user
    return None


class RoutingState:
    """What routing keeps across requests and reloads; one per gateway."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.calibration = CharsPerToken()
        self.tokenizers = TokenizerFiles()
        self.sessions = SessionTable()
        self._rng = rng or random.Random()
        self._routers: dict[tuple[str, str, float, bool, float], Router] = {}
        self._config: RoutingConfig | None = None

    def configure(self, config: RoutingConfig) -> None:
        """Apply a (reloaded) config's knobs; calibration and sessions are kept."""
        if config is self._config:
            return
        self._config = config
        estimator = config.estimator
        template = ChatTemplate(estimator.tokens_per_message, estimator.tokens_per_reply)
        self.calibration.prior = estimator.chars_per_token
        self.calibration.alpha = estimator.calibration_alpha
        self.calibration.template = template
        self.tokenizers.template = template
        self.sessions.resize(config.affinity.max_sessions)

    def router(self, pool: str, config: RoutingConfig) -> Router:
        affinity = config.affinity
        key = (pool, config.policy, config.near_equal, affinity.enabled, affinity.max_load)
        router = self._routers.get(key)
        if router is None:
            router = build_router(config.policy, near_equal=config.near_equal, rng=self._rng)
            if affinity.enabled:
                router = Sticky(router, self.sessions, affinity.max_load)
            self._routers = {k: r for k, r in self._routers.items() if k[0] != pool}
            self._routers[key] = router
        return router

    def estimate_locally(self, model: str, shape: PromptShape, config: RoutingConfig) -> Estimate:
        """Tokenizer count when one is configured for the model (mode tokenizer), else chars."""
        estimator = config.estimator
        path = estimator.tokenizers.get(model) if estimator.mode == "tokenizer" else None
        if path is not None:
            return self.tokenizers.count(path, shape)
        return self.calibration.estimate_with_floor(model, shape)


def least_busy(replicas: list[Replica]) -> Replica:
    """The replica with the most headroom, for calls outside admission (``/tokenize``)."""
    return min(replicas, key=lambda r: r.in_flight / max(1, r.limit))
