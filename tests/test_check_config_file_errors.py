"""``kneecap check-config FILE``: an error about the file as a whole (unreadable, no
YAML, no mapping) names the file once; it was printed as a header and again in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import run_cli


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (None, "cannot read config"),
        ("a: [\n", "invalid YAML"),
        ("[1, 2]\n", "the top level must be a mapping"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_a_file_level_error_names_the_file_once(
    tmp_path: Path, text: str | bytes | None, said: str
) -> None:
    path = tmp_path / "kneecap.yaml"
    if isinstance(text, str):
        path.write_text(text)
    elif isinstance(text, bytes):
        path.write_bytes(text)
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert said in result.stderr
    assert result.stderr.count(str(path)) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_key_error_still_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kneecap.yaml"
    path.write_text("listen: {port: high}\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert result.stderr.startswith(f"{path}: invalid config:\n")
    assert "listen.port" in result.stderr
    assert result.stderr.count(str(path)) == 1, result.stderr
