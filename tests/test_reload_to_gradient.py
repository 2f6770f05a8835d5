"""A reload that makes a backend's controller a ``gradient`` one starts it at the old
controller's limit, clamped (README, Configuration; policies/registry.py), whatever the
old controller's kind, and it measures its min-RTT later, as after gradient -> gradient.

Before: from static or knee, the new controller opened a min-RTT window at once, its limit
pinned at ``min`` (3) until the window had samples: for good on a backend without traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.gradient import GradientLimit, GradientLimitConfig
from policies.knee import KneeLimitConfig
from policies.registry import LimitConfig, build_controller, reconfigure
from policies.static import StaticLimitConfig
from tests.procs import Proc, backend, served, start_gateway, start_raw_sse
from tests.test_limit_gradient import sample
from tests.test_reload_live import reload

GRADIENT = GradientLimitConfig(initial=8, min=3, max=256, min_rtt_interval_s=60)


@pytest.mark.parametrize(
    "old",
    [StaticLimitConfig(initial=32, min=1, max=32), KneeLimitConfig(initial=32, max=256)],
    ids=["static", "knee"],
)
def test_a_controller_of_another_kind_hands_its_limit_to_a_gradient_one(
    old: LimitConfig,
) -> None:
    previous = build_controller(old, start=32)  # a knee controller past its ramp
    assert previous.limit == 32
    new = reconfigure(previous, GRADIENT)
    assert isinstance(new, GradientLimit)
    assert new.limit == 32 and not new.measuring_min_rtt
    assert new.update(sample(100.0, 0.1)) == 32  # no min-RTT yet: the limit holds
    assert new.update(sample(159.9, 0.5)) == 32
    assert new.update(sample(160.0, 0.1)) == 3  # a min_rtt_interval_s later: measured
    assert new.measuring_min_rtt
    assert new.update(sample(170.0, 0.1)) == 32  # back to the limit it carried
    assert new.min_rtt == 0.1 and not new.measuring_min_rtt


def test_the_carried_limit_is_clamped_into_the_gradient_bounds() -> None:
    previous = build_controller(StaticLimitConfig(initial=32, min=1, max=32))
    new = reconfigure(previous, GradientLimitConfig(initial=8, min=3, max=16))
    assert new.limit == 16


def test_a_fresh_gradient_controller_still_measures_first() -> None:
    assert build_controller(GRADIENT).limit == 3  # no limit to carry: Envoy's start


@pytest.fixture
def raw_proc(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(tmp_path))


def test_a_reload_to_gradient_keeps_an_idle_backends_limit(tmp_path: Path, raw_proc: Proc) -> None:
    config = {
        "backends": [backend("b", raw_proc.url, limit={"kind": "static", "initial": 32})],
        "health": {"interval_s": 60},
        "admission": {"control_interval_s": 0.1},
    }
    gw = start_gateway(tmp_path, config)
    try:
        assert gw.state()["backends"][0]["limit"] == 32
        limit = {"kind": "gradient", "initial": 8, "min": 3, "max": 256}
        reload(gw, {**config, "backends": [backend("b", raw_proc.url, limit=limit)]})
        assert gw.state()["backends"][0]["limit"] == 32  # before: 3
    finally:
        gw.proc.stop()
