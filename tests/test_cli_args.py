"""Command-line values that used to be taken for something else: each is now refused
by argparse, in one line naming the option, before anything starts."""

from __future__ import annotations

import pytest

from gateway.cli import MAX_SPEED, MIN_SPEED, build_parser
from tests.test_cli import run_cli


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What argparse says refusing ``argv`` (it exits 2)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "sim"])
@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused(
    capsys: pytest.CaptureFixture[str], command: str, host: str
) -> None:
    """``serve --host ""`` listened on the config's host instead, and ``sim --host ""`` on
    every interface (asyncio's reading of "")."""
    said = refusal(capsys, command, "--host", host)
    assert "argument --host: the address is empty" in said


@pytest.mark.parametrize("model", ["", " "])
def test_an_empty_sim_model_is_refused(capsys: pytest.CaptureFixture[str], model: str) -> None:
    """``sim --model ""`` served a model no client could name (every request a 404)."""
    said = refusal(capsys, "sim", "--model", model)
    assert "argument --model: the model name is empty" in said


def test_a_named_host_is_taken_as_given() -> None:
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert build_parser().parse_args(["serve"]).host is None  # the config's, later


@pytest.mark.parametrize(
    ("speed", "said"),
    [
        ("1e-310", "is outside 0.001-1000 times real time"),  # delays overflowed: slept forever
        ("0.0009", "is outside 0.001-1000 times real time"),
        ("1001", "is outside 0.001-1000 times real time"),
        ("1e308", "is outside 0.001-1000 times real time"),
        ("inf", "is not a positive number"),
        ("nan", "is not a positive number"),
        ("-1", "is not a positive number"),
    ],
)
def test_a_speed_out_of_range_is_refused(
    capsys: pytest.CaptureFixture[str], speed: str, said: str
) -> None:
    assert f"argument --speed: '{speed}' {said}" in refusal(capsys, "sim", "--speed", speed)


@pytest.mark.parametrize("speed", [MIN_SPEED, 1.0, 20.0, MAX_SPEED])
def test_a_speed_in_range_is_taken(speed: float) -> None:
    assert build_parser().parse_args(["sim", "--speed", str(speed)]).speed == speed


def test_the_refusal_is_one_line_from_the_command() -> None:
    result = run_cli("sim", "--speed", "1e-310")
    assert result.returncode == 2
    assert "is outside 0.001-1000 times real time" in result.stderr
    assert "Traceback" not in result.stderr
