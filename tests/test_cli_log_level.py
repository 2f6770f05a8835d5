"""``kneecap serve --log-level`` governs kneecap's own loggers, not only uvicorn's: at
``error`` the gateway still logged its INFO and WARNING lines, and at ``debug`` never its
debug ones (the root logger was set to INFO whatever the flag said)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import Proc, backend, free_port, served, start_process, start_sim, wait_until


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Proc]:
    yield from served(start_sim(tmp_path, ttft_ms=1, itl_ms=1))


def serve(tmp_path: Path, config: dict[str, Any], level: str) -> tuple[Proc, Path]:
    port = free_port()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    args = ["serve", "--config", str(path), "--log-level", level]
    url = f"http://127.0.0.1:{port}"
    return start_process(args, url, "/health", tmp_path / f"gw-{level}.log"), path


def logged(proc: Proc, level: str) -> list[str]:
    return [line for line in proc.output().splitlines() if f" {level} kneecap" in line]


def test_log_level_error_keeps_only_errors(tmp_path: Path, sim: Proc) -> None:
    config = {"backends": [backend("a", sim.url)]}
    gw, path = serve(tmp_path, config, "error")
    try:
        # Applied, a reload logs at INFO; two backends at one URL add a WARNING.
        both = {**config, "backends": [backend("a", sim.url), backend("a2", sim.url)]}
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **both}))
        assert httpx.post(gw.url + "/admin/reload", timeout=5).status_code == 200
        path.write_text("backends: 3\n")
        assert httpx.post(gw.url + "/admin/reload", timeout=5).status_code == 400
        wait_until(lambda: logged(gw, "ERROR") != [])  # the refusal, at ERROR
    finally:
        gw.stop()
    assert logged(gw, "INFO") == [] and logged(gw, "WARNING") == [], gw.output()


def test_log_level_debug_shows_kneecap_debug_lines(tmp_path: Path, sim: Proc) -> None:
    config = {"backends": [backend("a", sim.url)], "watch_config": True}
    gw, path = serve(tmp_path, config, "debug")
    try:
        path.write_text(path.read_text().replace("name: a", "name: b"))
        wait_until(lambda: "config reload: config applied" in gw.output())
        assert any(" DEBUG kneecap.config: " in line for line in gw.output().splitlines())
    finally:
        gw.stop()


@pytest.mark.parametrize("level", ["info", "debug"])
def test_other_libraries_log_only_their_warnings(level: str) -> None:
    """Set for kneecap, INFO on the root logger let every library's INFO lines through:
    ``kneecap bench --plot`` on a first run printed matplotlib's font-cache line among its
    own refusals (a CI run on a fresh virtualenv, where the cache did not exist yet)."""
    script = (
        "import logging; from gateway.cli import _configure_logging\n"
        f"_configure_logging({level!r})\n"
        "logging.getLogger('matplotlib.font_manager').info('their info')\n"
        "logging.getLogger('httpx').debug('their debug')\n"
        "logging.getLogger('matplotlib').warning('their warning')\n"
        "logging.getLogger('kneecap.health').info('our info')\n"
        "logging.getLogger('kneecap').debug('our debug')\n"
    )
    said = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stderr
    assert "their info" not in said and "their debug" not in said
    assert "their warning" in said and "our info" in said
    assert ("our debug" in said) == (level == "debug")
