"""The simulator against the field figures, in virtual time (issue 3)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from backends.sim import calibration
from backends.sim.calibration import Check, calibration_checks, calibration_table
from backends.sim.closedloop import output_throughput, percentile, run_closed_loop
from backends.sim.profiles import get_profile
from backends.sim.speedbench import measure as speed


@pytest.fixture(scope="module")
def checks() -> tuple[dict[str, list[Check]], float]:
    start = time.process_time()
    result = calibration_checks()
    return result, time.process_time() - start


def _failures(group: list[Check]) -> list[str]:
    return [f"{c.name}: sim {c.sim:.4g} not in [{c.lo:.4g}, {c.hi:.4g}]" for c in group if not c.ok]


@pytest.mark.parametrize("group", list(calibration.CHECK_GROUPS))
def test_calibration_group(checks: tuple[dict[str, list[Check]], float], group: str) -> None:
    result, _ = checks
    assert result[group], "an empty group checks nothing"
    assert not _failures(result[group])


def test_the_whole_calibration_set_is_fast(checks: tuple[dict[str, list[Check]], float]) -> None:
    _, cpu_seconds = checks
    assert cpu_seconds < 30


def test_table_lists_every_check_next_to_the_field_figure() -> None:
    table = calibration_table()  # cached runs: cheap after the fixture
    assert "NO" not in table.split()
    assert "throughput c=32" in table and "1,088" in table
    assert "2816-token outputs" in table


def test_the_knee_comes_from_kv_capacity_not_from_a_rule() -> None:
    """Give the same GPU twice the KV cache: the knee at 64 must soften."""
    base = get_profile(calibration.BASE)
    roomy = dataclasses.replace(base, kv_tokens=base.kv_tokens * 2)
    runs = {}
    for name, profile in (("base", base), ("roomy", roomy)):
        records = run_closed_loop(profile, 64, 1024, calibration.OUTPUT_TOKENS, 320)
        runs[name] = (output_throughput(records), percentile([r.ttft for r in records], 50))
    assert runs["roomy"][0] > 1.05 * runs["base"][0]  # more sequences decode at once
    assert runs["roomy"][1] < 0.3 * runs["base"][1]  # nobody waits for KV blocks


def test_runs_are_deterministic() -> None:
    profile = get_profile("qwen3-4b/l40s/bf16/sglang")
    a = run_closed_loop(profile, 16, 1024, 300, 64, seed=3, ignore_eos=False)
    b = run_closed_loop(profile, 16, 1024, 300, 64, seed=3, ignore_eos=False)
    assert [(r.ttft, r.e2e, r.output_tokens) for r in a] == [
        (r.ttft, r.e2e, r.output_tokens) for r in b
    ]
    assert len({r.output_tokens for r in a}) > 5  # EOS really varied the lengths


def test_engine_speed_with_64_running_sequences() -> None:
    steps, cpu = speed(steps=30_000)
    # The benchmark's target is 50,000/CPU-s; leave headroom for a busy CI box.
    assert steps / cpu > 30_000
