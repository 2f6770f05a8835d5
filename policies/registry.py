"""Limit controllers by name, and what happens to a controller on config reload.

``LimitConfig`` is the discriminated union the gateway's settings embed
(``kind: static | knee | gradient``). Adding a controller means one module with
a config model and a class, plus one row in ``_BUILDERS``.

Reload semantics (``reconfigure``): the replacement controller is built from
the new config and *starts at the old controller's limit, clamped into the new
[min, max]*; an adaptive controller resumes carefully from there (the knee
controller skips its start-up ramp and keeps what it measured of the backend,
its solo decode speed, when the old controller was a knee controller too; a
gradient controller keeps its min-RTT from a gradient controller, and from another
kind measures it a ``min_rtt_interval_s`` after its first sample rather than at
once, at ``min``). A static controller takes its new configured value instead. Permits already
held and requests already queued are untouched: they live in admission, not
here; a lower limit only stops new admissions until in-flight work drains
below it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import Discriminator, Tag

from policies.base import LimitController
from policies.gradient import GradientLimit, GradientLimitConfig
from policies.knee import KneeLimit, KneeLimitConfig
from policies.static import StaticLimit, StaticLimitConfig


def _kind_of(value: Any) -> str | None:
    """A limit block without ``kind`` is the default controller's, ``knee``."""
    if isinstance(value, Mapping):
        return value.get("kind", "knee")
    return getattr(value, "kind", None)


LimitConfig = Annotated[
    Annotated[StaticLimitConfig, Tag("static")]
    | Annotated[KneeLimitConfig, Tag("knee")]
    | Annotated[GradientLimitConfig, Tag("gradient")],
    Discriminator(
        _kind_of,
        custom_error_type="invalid_limit_kind",
        custom_error_message="`kind` must be one of static, knee, gradient",
    ),
]

# Each builder takes its own config type and an optional carried-over limit.
_BUILDERS: Mapping[str, Callable[[Any, int | None], LimitController]] = MappingProxyType(
    {
        "static": StaticLimit,
        "knee": KneeLimit,
        "gradient": GradientLimit,
    }
)


def controller_kinds() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build_controller(config: LimitConfig, *, start: int | None = None) -> LimitController:
    """A fresh controller for ``config``; ``start`` overrides ``config.initial``."""
    return _BUILDERS[config.kind](config, start)


def reconfigure(old: LimitController, new_config: LimitConfig) -> LimitController:
    """The controller to use after a reload; see the module doc for the semantics."""
    # Inside its min_rtt window a gradient controller's limit is pinned at min: what it
    # will come back to is the limit to carry.
    start = new_config.clamp(old.settled_limit if isinstance(old, GradientLimit) else old.limit)
    if isinstance(new_config, KneeLimitConfig) and isinstance(old, KneeLimit):
        return KneeLimit(new_config, start, solo=old.learned)
    if isinstance(new_config, GradientLimitConfig):
        # Not in a min_rtt window, which would pin it at min: it carries the limit on.
        min_rtt = old.min_rtt if isinstance(old, GradientLimit) else None
        return GradientLimit(new_config, start, min_rtt=min_rtt, carried=True)
    return build_controller(new_config, start=start)
