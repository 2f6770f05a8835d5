from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs
from tests.procs import Gateway, Proc, backend, start_gateway, start_sim


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run() -> Iterator[None]:
    yield
    procs.stop_all_started_since(0)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test() -> Iterator[None]:
    """Stops what the test (or its function-scoped fixtures) started and left running.

    Broader-scoped fixtures are set up before this one, so their processes are not
    counted; function-scoped fixtures are torn down before it, so theirs are already
    stopped when it looks.
    """
    first = len(procs.STARTED)
    yield
    procs.stop_all_started_since(first)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("procs")


@pytest.fixture(scope="session")
def sims(session_tmp: Path) -> Iterator[list[Proc]]:
    """Two fast fixed-latency backends shared by the read-only proxy tests."""
    started = [start_sim(session_tmp, ttft_ms=5, itl_ms=2) for _ in range(2)]
    try:
        yield started
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="session")
def gateway(session_tmp: Path, sims: list[Proc]) -> Iterator[Gateway]:
    config = {
        "backends": [backend(f"sim-{i}", p.url) for i, p in enumerate(sims)],
        "health": {"interval_s": 0.5},
    }
    gw = start_gateway(session_tmp, config)
    try:
        yield gw
    finally:
        gw.proc.stop()


@pytest.fixture(scope="session")
def live_gateway(gateway: Gateway) -> str:
    return gateway.url
