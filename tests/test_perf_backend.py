"""The relay bench's fast backend, as a router that rewrites requests reaches it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.perf import procs
from gateway.perf.backend import MODEL


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[str]:
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["gateway.perf.backend", "--port", str(port)]
    proc = procs.start("backend", args, url, "/health", tmp_path / "backend.log", core=None)
    try:
        yield url
    finally:
        proc.stop()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_the_output_length_is_read_under_either_name(backend: str, field: str) -> None:
    """sglang-router passes ``max_tokens`` on as ``max_completion_tokens``: read as the
    other, a bench through it would stream the default length instead."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 3}
    with httpx.stream("POST", f"{backend}/v1/chat/completions", json={**body, "stream": True}) as r:
        text = "".join(r.iter_text())
    assert text.count('"content":" knee"') == 3, text
    answer = httpx.post(f"{backend}/v1/chat/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] == 3, answer
