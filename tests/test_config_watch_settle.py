"""``watch_config`` and a file written in place (shell ``>``, ``envsubst >``, ``tee``, an
editor saving over it; a bind-mounted single file receives only such writes): the watcher
used to reload the file it caught empty, serving no backend, and since an empty file says
``watch_config: false`` by default, it then stopped watching and never applied the rest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Gateway, Proc, backend, start_gateway, start_sim, wait_until

RELOADS = "kneecap_config_reloads_total{"


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    a, b = start_sim(tmp_path, ttft_ms=1, itl_ms=1), start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def reloads(gw: Gateway) -> dict[str, float]:
    """Reloads counted so far by result (success, error), whatever triggered them."""
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith(RELOADS)]
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in lines}


def names(gw: Gateway) -> list[str]:
    return sorted(b["name"] for b in gw.state()["backends"] if not b["draining"])


def test_a_file_caught_empty_is_refused_and_the_finished_file_applies(
    tmp_path: Path, sims: tuple[Proc, Proc]
) -> None:
    a, b = sims
    gw = start_gateway(tmp_path, {"backends": [backend("a", a.url)], "watch_config": True})
    finished = {**gw.config, "backends": [backend("a", a.url), backend("b", b.url)]}
    try:
        before = reloads(gw)
        with open(gw.config_path, "w") as writer:  # truncated: the writer has not written yet
            wait_until(lambda: sum(reloads(gw).values()) > sum(before.values()))
            assert reloads(gw).get("error", 0) == before.get("error", 0) + 1
            assert names(gw) == ["a"]  # still serving the old config
            writer.write(yaml.safe_dump(finished))
        wait_until(lambda: names(gw) == ["a", "b"])
        assert "the file is empty" in gw.proc.output()
    finally:
        gw.proc.stop()


def test_a_file_silent_on_watch_config_leaves_the_watcher_on(
    tmp_path: Path, sims: tuple[Proc, Proc]
) -> None:
    a, b = sims
    gw = start_gateway(tmp_path, {"backends": [backend("a", a.url)], "watch_config": True})
    complete = yaml.safe_dump({**gw.config, "backends": [backend("a", a.url), backend("b", b.url)]})
    last_line = "watch_config: true\n"
    assert complete.endswith(last_line)  # keys sorted: the writer writes this one last
    try:
        with open(gw.config_path, "w") as writer:
            writer.write(complete.removesuffix(last_line))
            writer.flush()
            # Caught half written, the file is a valid config that never names the key.
            wait_until(lambda: names(gw) == ["a", "b"])
            writer.write(last_line)
        gw.write_config({**gw.config, "backends": [backend("b", b.url)]})
        wait_until(lambda: names(gw) == ["b"])  # the watcher still runs
    finally:
        gw.proc.stop()


def test_an_empty_file_is_refused_by_any_reload_and_backends_empty_is_not(
    tmp_path: Path, sims: tuple[Proc, Proc]
) -> None:
    a, _ = sims
    gw = start_gateway(tmp_path, {"backends": [backend("a", a.url)]})
    try:
        gw.config_path.write_text("# nothing here yet\n")
        answer = httpx.post(gw.url + "/admin/reload", timeout=5)
        assert answer.status_code == 400, answer.text
        assert "the file is empty" in answer.text
        assert names(gw) == ["a"]
        gw.write_config({**gw.config, "backends": []})  # on purpose: say so
        assert httpx.post(gw.url + "/admin/reload", timeout=5).status_code == 200
        assert names(gw) == []
    finally:
        gw.proc.stop()
