"""The command line: check-config, env overrides, and `kneecap serve` on its embedded default."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gateway.settings import ConfigError, load_settings
from tests.procs import MODEL, free_port, start_process


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_check_config_accepts_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:9', pool: long}\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "pool long" in result.stdout and "a" in result.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("backends:\n  - {name: a, url: 'http://x', pool: nope}\n", "pool 'nope'"),
        ("listen: {port: high}\n", "listen.port"),
        ("backends:\n  - {name: a}\n", "backends.0"),
        ("pools: {short: {max_queue_depth: -1}}\n", "pools.short.max_queue_depth"),
        ("surprise: 1\n", "surprise"),
        ("[1, 2]\n", "top level must be a mapping"),
    ],
)
def test_check_config_names_the_bad_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert expected in result.stderr


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: {port: 9000}\nbackends: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    monkeypatch.setenv("KNEECAP_LISTEN__PORT", "9100")
    monkeypatch.setenv("KNEECAP_HEALTH__INTERVAL_S", "0.25")
    settings = load_settings(path)
    assert settings.listen.port == 9100 and settings.health.interval_s == 0.25
    assert settings.backends[0].name == "a"
    monkeypatch.setenv("KNEECAP_LISTEN__PORT", "not-a-port")
    with pytest.raises(ConfigError, match=r"listen\.port"):
        load_settings(path)


def test_settings_are_frozen() -> None:
    settings = load_settings(None)
    with pytest.raises(Exception, match="frozen"):
        settings.listen.port = 1  # type: ignore[misc]


def test_serve_runs_the_embedded_default_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process(
        ["serve", "--port", str(port)], f"http://127.0.0.1:{port}", "/ready", tmp_path / "serve.log"
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 5
        state = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=5).json()
        pools = sorted(b["pool"] for b in state["backends"])
        assert pools == ["long", "short", "short"]
    finally:
        code = proc.stop(signal.SIGINT)
    assert code == 0, proc.output()
    output = proc.output()
    assert 'OpenAI(base_url="http://127.0.0.1:' in output
    assert "Traceback" not in output
