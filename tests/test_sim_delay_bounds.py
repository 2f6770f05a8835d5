"""``kneecap sim --ttft-ms/--itl-ms``: a delay beyond an hour is a slip (1e308 slept
forever or overflowed the clock), refused by argparse in a line naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser
from tests.test_cli_args import refusal
from tests.test_cli_bench_fixes import cli


@pytest.mark.parametrize("flag", ["--ttft-ms", "--itl-ms"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        *((v, "is more than an hour (3600000 ms)") for v in ("1e308", "3600000.5", "1e7")),
        *((v, "is not a non-negative number") for v in ("inf", "nan", "-1")),  # as before
    ],
)
def test_a_delay_over_an_hour_or_no_number_is_refused(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, why: str
) -> None:
    said = refusal(capsys, "sim", flag, value)
    assert f"argument {flag}: '{value}' {why}" in said


@pytest.mark.parametrize("value", [0.0, 50.0, 3_600_000.0])
def test_a_delay_up_to_an_hour_is_taken(value: float) -> None:
    args = build_parser().parse_args(["sim", "--ttft-ms", str(value), "--itl-ms", str(value)])
    assert (args.ttft_ms, args.itl_ms) == (value, value)


def test_the_command_refuses_it_in_one_line() -> None:
    result = cli("sim", "--port", "0", "--itl-ms", "1e308", timeout=20)
    assert result.returncode == 2
    assert "argument --itl-ms: '1e308' is more than an hour" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["1e308", ".inf"])
def test_a_config_with_such_a_delay_is_refused_by_key(tmp_path: Path, value: str) -> None:
    config = tmp_path / "kneecap.yaml"
    config.write_text(f"backends: [{{name: s, sim: {{ttft_ms: {value}}}}}]\n")
    result = cli("check-config", str(config), timeout=20)
    assert result.returncode == 1
    assert "backends.0.sim.ttft_ms" in result.stderr
    assert "3600000" in result.stderr
