"""``--port``: only ASCII digits. ``str.isdigit`` also took "١٢" (Arabic-Indic 12) and
fullwidth digits, which int() reads as numbers: the server listened on port 12."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser
from tests.test_cli_args import refusal


@pytest.mark.parametrize("command", ["serve", "sim"])
@pytest.mark.parametrize("port", ["١٢", "\uff18\uff10", "²"])
def test_a_port_in_other_digits_is_refused(
    capsys: pytest.CaptureFixture[str], command: str, port: str
) -> None:
    said = refusal(capsys, command, "--port", port)
    assert f"argument --port: {port!r} is not a port (0-65535)" in said


def test_an_ascii_port_is_taken() -> None:
    assert build_parser().parse_args(["serve", "--port", "8080"]).port == 8080
    assert build_parser().parse_args(["sim", "--port", "0"]).port == 0
