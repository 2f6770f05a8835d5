"""The static controller, the config models and the registry (build, reload)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from policies.base import Sample
from policies.gradient import GradientLimit
from policies.knee import KneeLimit, KneeLimitConfig
from policies.registry import LimitConfig, build_controller, controller_kinds, reconfigure
from policies.static import StaticLimit, StaticLimitConfig

CONFIG: TypeAdapter[LimitConfig] = TypeAdapter(LimitConfig)


def busy(now: float, ttft: float | None) -> Sample:
    return Sample(
        now=now,
        ttft_p95=ttft,
        itl_p95=0.02,
        output_tokens_per_s=900.0,
        in_flight=32,
        completed=12,
        engine_waiting=3,
        demand=50,
    )


def test_static_stays_put_whatever_it_sees() -> None:
    ctl = StaticLimit(StaticLimitConfig(initial=24))
    for t, ttft in enumerate([0.01, 5.0, None, 0.3] * 10):
        assert ctl.update(busy(float(t), ttft)) == 24
    assert ctl.limit == 24


def test_config_union_picks_the_model_by_kind() -> None:
    assert isinstance(CONFIG.validate_python({"kind": "static", "initial": 12}), StaticLimitConfig)
    knee = CONFIG.validate_python({"kind": "knee", "ttft_p95_slo": 0.25})
    assert isinstance(knee, KneeLimitConfig) and knee.ttft_p95_slo == 0.25
    with pytest.raises(ValidationError):
        CONFIG.validate_python({"kind": "aimd"})


def test_config_embeds_in_settings_and_is_frozen() -> None:
    class PoolSettings(BaseModel):
        limit: LimitConfig = KneeLimitConfig()

    pool = PoolSettings.model_validate({"limit": {"kind": "gradient", "buffer": 0.5}})
    assert pool.limit.kind == "gradient"
    assert PoolSettings().limit.kind == "knee"
    with pytest.raises(ValidationError):
        pool.limit.initial = 3


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "knee", "min": 10, "initial": 5},
        {"kind": "knee", "max": 4, "initial": 8},
        {"kind": "static", "min": 0},
        {"kind": "knee", "margin": 1.0},
        {"kind": "knee", "typo_knob": 1},
    ],
)
def test_invalid_configs_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CONFIG.validate_python(bad)


def test_registry_builds_every_kind() -> None:
    assert set(controller_kinds()) == {"static", "knee", "gradient"}
    built = {
        kind: build_controller(CONFIG.validate_python({"kind": kind, "initial": 9}))
        for kind in controller_kinds()
    }
    assert isinstance(built["static"], StaticLimit)
    assert isinstance(built["knee"], KneeLimit)
    assert isinstance(built["gradient"], GradientLimit)
    assert built["knee"].limit == 4  # ramping up to 9 at 4 permits/s
    assert build_controller(KneeLimitConfig(initial=9), start=20).limit == 20


def test_reload_carries_the_limit_into_the_new_bounds() -> None:
    old = build_controller(KneeLimitConfig(initial=8), start=40)
    new = reconfigure(old, KneeLimitConfig(initial=8))
    assert new.limit == 40 and new is not old
    assert reconfigure(old, KneeLimitConfig(initial=8, max=30)).limit == 30
    assert reconfigure(old, KneeLimitConfig(initial=64, min=50, max=100)).limit == 50
    # Across kinds too: a knee limit becomes the gradient controller's starting point.
    gradient = reconfigure(old, CONFIG.validate_python({"kind": "gradient"}))
    assert isinstance(gradient, GradientLimit)
    assert gradient.limit == 40 and not gradient.measuring_min_rtt  # no window at min first


def test_reload_to_static_takes_the_configured_value() -> None:
    old = build_controller(KneeLimitConfig(initial=8), start=40)
    assert reconfigure(old, StaticLimitConfig(initial=16)).limit == 16
