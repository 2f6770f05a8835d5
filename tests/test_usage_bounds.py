"""A usage whose counts are out of range (negative, or past any engine's) is ignored like
one that is no whole numbers: the request is still answered, counted and listed; and
no count, however large, makes the per-token gaps a list beyond a bound of the events
the stream really carried."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.meter import MAX_TOKENS_PER_GAP, MAX_USAGE_TOKENS, Usage
from tests.procs import (
    Gateway,
    Proc,
    scripted_config,
    served,
    served_gateway,
    start_raw_sse,
)
from tests.raw_sse_backend import MODEL
from tests.test_meter_fixes import delta, fed
from tests.test_proxy_wire import new_id, record_of, requests_total
from tests.test_relay_edge_cases import CHAT, DONE, STREAM, body, chunked_stream, event


@pytest.mark.parametrize(
    "counts",
    [
        {"prompt_tokens": -1, "completion_tokens": 2},
        {"prompt_tokens": 3, "completion_tokens": -2},
        {"prompt_tokens": MAX_USAGE_TOKENS, "completion_tokens": 2},
        {"prompt_tokens": 3, "completion_tokens": 10**18},
    ],
)
def test_a_count_out_of_range_is_no_usage(counts: dict[str, int]) -> None:
    assert Usage.from_json(counts) is None


def test_counts_in_range_are_read() -> None:
    assert Usage.from_json({"prompt_tokens": 0, "completion_tokens": 0}) == Usage(0, 0)
    largest = MAX_USAGE_TOKENS - 1
    assert Usage.from_json({"prompt_tokens": largest, "completion_tokens": 1}) == Usage(largest, 1)
    assert Usage.from_json({"completion_tokens": 5}) == Usage(0, 5)  # prompt not reported


def test_a_huge_count_spreads_each_gap_over_a_bounded_number_of_tokens() -> None:
    """Three events, a usage of a million tokens: the per-token gaps stay a few hundred
    values (it was a list of a million; at 10^9, GBs built in one blocked loop turn)."""
    meter = fed([(0.1 * k, delta(content="x")) for k in range(1, 4)])
    meter.usage = Usage(5, 10**6)
    gaps = meter.token_gaps()
    assert len(gaps) <= 2 * MAX_TOKENS_PER_GAP
    assert sum(gaps) == pytest.approx(0.2)
    assert meter.tokens_per_event is not None and meter.tokens_per_event <= MAX_TOKENS_PER_GAP


# --- through the gateway --------------------------------------------------------


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage")


@pytest.fixture(scope="module")
def raw(module_tmp: Path) -> Iterator[Proc]:
    yield from served(start_raw_sse(module_tmp))


@pytest.fixture(scope="module")
def gw(module_tmp: Path, raw: Proc) -> Iterator[Gateway]:
    yield from served_gateway(module_tmp, scripted_config(raw))


def _whole(counts: dict[str, int]) -> list[list[Any]]:
    answer = {
        "id": "c",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": counts,
    }
    payload = json.dumps(answer)
    head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    return [["send", f"{head}content-length: {len(payload)}\r\n\r\n{payload}"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_negative_usage_still_counts_and_lists_the_request(gw: Gateway, stream: bool) -> None:
    """It raised in the recorder (a Prometheus counter cannot go down): the request was
    in no ``kneecap_requests_total`` and not in /admin/requests."""
    counts = {"prompt_tokens": -1, "completion_tokens": 2, "total_tokens": 1}
    if stream:
        script = chunked_stream(*STREAM, event(choices=[], usage=counts), DONE)
    else:
        script = _whole(counts)
    before = requests_total(gw, status="ok")
    request_id = new_id("negative")
    answer = httpx.post(
        gw.url + CHAT,
        json=body(script, stream=stream),
        headers={"x-request-id": request_id},
        timeout=10,
    )
    assert answer.status_code == 200
    record = record_of(gw, request_id)
    assert record["status"] == "ok"
    assert record["prompt_tokens"] is None and record["completion_tokens"] is None
    assert requests_total(gw, status="ok") == before + 1


def test_a_huge_completion_count_through_the_gateway_keeps_the_itl_bounded(gw: Gateway) -> None:
    counts = {"prompt_tokens": 3, "completion_tokens": 10**6, "total_tokens": 10**6 + 3}
    script = chunked_stream(*STREAM, event(choices=[], usage=counts), DONE)
    request_id = new_id("huge")
    answer = httpx.post(
        gw.url + CHAT, json=body(script), headers={"x-request-id": request_id}, timeout=10
    )
    assert answer.status_code == 200
    record = record_of(gw, request_id)
    assert record["completion_tokens"] == 10**6  # in range: taken at its word
    assert 0 < record["itl_count"] <= 3 * MAX_TOKENS_PER_GAP
