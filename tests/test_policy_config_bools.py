"""``true``/``false`` where a limit controller wants a number is refused, as it is in the
gateway's own settings: pydantic read ``limit: {kind: static, initial: true}`` as a
static limit of 1 and ``check-config`` said ok."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import build_settings
from tests.test_cli import run_cli

BACKEND = "{name: a, url: 'http://127.0.0.1:9'}"


@pytest.mark.parametrize(
    ("limit", "key", "value"),
    [
        ("{kind: static, initial: true}", "initial", "true"),
        ("{kind: knee, max_step: false}", "max_step", "false"),
        ("{kind: gradient, buffer: true}", "buffer", "true"),
        ("{max: true}", "max", "true"),  # no kind: the default controller, knee
    ],
)
def test_check_config_refuses_yes_or_no_for_a_limit_number(
    tmp_path: Path, limit: str, key: str, value: str
) -> None:
    for where, text in (
        ("admission.limit", f"backends:\n  - {BACKEND}\nadmission: {{limit: {limit}}}\n"),
        (
            "backends.0.limit",
            f"backends:\n  - {{name: a, url: 'http://127.0.0.1:9', limit: {limit}}}\n",
        ),
    ):
        path = tmp_path / "config.yaml"
        path.write_text(text)
        result = run_cli("check-config", str(path))
        assert result.returncode == 1, (where, result.stdout)
        assert where in result.stderr, result.stderr
        assert f"`{key}` must be a number, got {value}" in result.stderr, result.stderr


def test_numbers_and_the_kind_still_load() -> None:
    limit = {"kind": "knee", "initial": 4, "max_step": 0.25, "settle_s": 0}
    loaded = build_settings({"admission": {"limit": limit}}).admission.limit
    assert (loaded.kind, loaded.initial, loaded.max_step, loaded.settle_s) == ("knee", 4, 0.25, 0)
