"""What a config may load with and still not mean: warned of, never refused.

``kneecap serve`` and ``kneecap check-config`` print these at start, a reload logs them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.settings import CONFIG_ENV, ENV_PREFIX, PoolConfig, Settings

# Kubernetes gives every pod `<SERVICE>_PORT`, `<SERVICE>_SERVICE_HOST`, ... for each
# service in its namespace, so a service named `kneecap` sets these.
_SERVICE_LINK = re.compile(r"^KNEECAP_(PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?|SERVICE_\w+)$", re.I)


def ignored_environment(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """``KNEECAP_*`` variables that name no setting: most likely a misspelt override.

    A misspelt nested key (``KNEECAP_HEALTH__INTERVALS``) is refused like a file's; a
    misspelt first level (``KNEECAP_HEALHT__INTERVAL_S``) is not seen by the settings at
    all, so the gateway would run on the value it was meant to replace. Not refused:
    other programs may own variables with this prefix.
    """
    own = {CONFIG_ENV.upper()}
    if settings.auth.api_keys_env:
        own.add(settings.auth.api_keys_env.upper())
    own.update(b.api_key_env.upper() for b in settings.backends if b.api_key_env)
    fields = set(Settings.model_fields)
    ignored = []
    for name in environ:
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in own or _SERVICE_LINK.match(upper):
            continue
        if upper[len(ENV_PREFIX) :].split("__", 1)[0].lower() not in fields:
            ignored.append(name)
    return sorted(ignored)


def shared_engines(settings: Settings) -> list[str]:
    """Warnings for backends at one URL: each admits up to its own limit, so the engine
    gets their sum. Not refused: one engine in two pools (two queues, two limits
    summing to its knee) is a setup of its own, and tests use it."""
    by_url: dict[str, list[str]] = {}
    for b in settings.backends:
        if b.url is not None:
            by_url.setdefault(_same_engine(b.url), []).append(b.name)
    return [
        f"backends {', '.join(names)} are one engine ({url}): each admits up to its own "
        "limit, the engine gets their sum"
        for url, names in by_url.items()
        if len(names) > 1
    ]


def shadowed_pools(settings: Settings) -> list[str]:
    """Warnings for pools whose whole range earlier pools hold, for a model they share:
    the home pool is the first (config order) whose range holds the prompt among those
    that serve its model, so such a pool is home only when the earlier ones cannot (their
    backends down, or their context too short), and otherwise serves only what spills."""
    models = {name: _models_of(settings, name) for name in settings.pools}
    warnings = []
    pools = list(settings.pools.items())
    for i, (name, pool) in enumerate(pools):
        if models[name] == frozenset():
            continue  # no backend: nothing to shadow
        earlier = [
            (other, cover)
            for other, cover in pools[:i]
            if models[other] != frozenset() and _may_share(models[name], models[other])
        ]
        if earlier and _covered(pool, [cover for _, cover in earlier]):
            names = ", ".join(repr(other) for other, _ in earlier)
            warnings.append(
                f"pool {name!r} is no request's home while {names} can serve it: earlier in "
                "the config, they hold its whole range of prompt lengths"
            )
    return warnings


def _models_of(settings: Settings, pool: str) -> frozenset[str] | None:
    """The models a pool's backends serve; None when one learns them at run time."""
    models: set[str] = set()
    for backend in settings.backends:
        if backend.pool == pool:
            if not backend.models:
                return None
            models.update(backend.models)
    return frozenset(models)


def _may_share(a: frozenset[str] | None, b: frozenset[str] | None) -> bool:
    return a is None or b is None or bool(a & b)


def config_warnings(settings: Settings) -> list[str]:
    """What loads but is most likely not what was meant."""
    return no_backends(settings) + shared_engines(settings) + shadowed_pools(settings)


def no_backends(settings: Settings) -> list[str]:
    # An empty file loads (every key has a default), and a gateway with nothing behind it
    # answers every proxied request 404: without --config it would have run the simulator.
    if settings.backends:
        return []
    return ["no backends configured: every proxied request will be answered 404 model_not_found"]


def _covered(pool: PoolConfig, covers: list[PoolConfig]) -> bool:
    """Whether the union of ``covers``' ranges holds all of ``pool``'s."""
    start, end = pool.min_prompt_tokens, pool.max_prompt_tokens
    for cover in sorted(covers, key=lambda c: c.min_prompt_tokens):
        if cover.min_prompt_tokens > start:
            return False  # a gap at ``start``
        if cover.max_prompt_tokens is None:
            return True
        start = max(start, cover.max_prompt_tokens)
        if end is not None and start >= end:
            return True
    return False


def _same_engine(url: str) -> str:
    """A URL as one engine is known by: scheme and host are case-blind, the port
    defaults by scheme, and a trailing slash changes nothing."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    return (
        f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{port}{parts.path.rstrip('/')}"
    )
