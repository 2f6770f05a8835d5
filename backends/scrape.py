"""Scrapes each backend engine's own /metrics for its load gauges.

The values land on the replica's live state (for policies) with the time they
were read; consumers treat them as absent once older than the staleness limit.
An engine without /metrics (404, or an ``openai`` backend) is left alone: the
gateway's own in-flight counts stand in for it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator

import anyio
import httpx

from backends.engines import ENGINE_METRICS, EngineMetricNames
from backends.pool import BackendSet
from backends.replica import EngineGauges, Replica

log = logging.getLogger("kneecap.scrape")


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_CAPACITY_NAMES = ("vllm:cache_config_info", "sglang:max_total_num_tokens")


def samples(text: str, names: tuple[str, ...]) -> Iterator[tuple[str, str, float]]:
    """(name, label text, value) of every sample of ``names`` in a text exposition.

    A real engine's /metrics runs to thousands of lines, mostly histogram buckets
    nobody here reads; a full parse of it every second costs a large share of a
    core. Lines are skipped by a prefix test in C, and only the wanted ones are
    taken apart. Names must match exactly: ``vllm:num_requests_waiting_by_reason``
    is not ``vllm:num_requests_waiting``.
    """
    for line in text.splitlines():
        if not line.startswith(names):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, close = line[:brace], line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, labels, rest = line[:space], "", line[space:]
        if name not in names:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            yield name, labels, float(fields[0])
        except ValueError:
            continue


def parse_engine_gauges(text: str, names: EngineMetricNames, now: float) -> EngineGauges:
    """Data-parallel ranks report one series each: requests add up across them, and
    the KV cache usage is their mean, the share of the backend's whole cache in use
    (ranks hold equal caches), so that it stays a fraction."""
    wanted = names.running + names.waiting + names.kv_usage
    totals: dict[str, float] = {}
    series: dict[str, int] = {}
    for name, _, value in samples(text, wanted):
        totals[name] = totals.get(name, 0.0) + value
        series[name] = series.get(name, 0) + 1

    def first(candidates: tuple[str, ...]) -> float | None:
        return next((totals[n] for n in candidates if n in totals), None)

    def mean(candidates: tuple[str, ...]) -> float | None:
        return next((totals[n] / series[n] for n in candidates if n in totals), None)

    return EngineGauges(
        running=first(names.running),
        waiting=first(names.waiting),
        kv_usage=mean(names.kv_usage),
        scraped_at=now,
    )


def parse_kv_capacity(text: str) -> int | None:
    """The engine's KV cache size in tokens, where its /metrics says it: the whole
    backend's, as KV usage is the share of the whole in use (:func:`parse_engine_gauges`).

    vLLM: ``vllm:cache_config_info`` labels ``num_gpu_blocks`` times ``block_size``. Its
    series per data-parallel engine (``engine="0"``, ``"1"``...) all repeat the API
    server's cache config, whose ``num_gpu_blocks`` is already the sum over the engines it
    started (``wait_for_engine_startup`` in vllm/v1/engine/utils.py): one series is the
    whole, and a sum would count it once per rank. SGLang: ``sglang:max_total_num_tokens``,
    one series per scheduler; the tensor, pipeline and expert ranks of a data-parallel rank
    share its pool (the largest counts), each ``dp_rank`` has one of its own (they add up).
    Series that carry no ``dp_rank`` cannot be told apart: the largest is the safe side.
    """
    pools: dict[tuple[str, str], int] = {}  # (name, data-parallel rank) → its pool
    for name, labels, value in samples(text, _CAPACITY_NAMES):
        found = dict(_LABEL.findall(labels))
        if name == "sglang:max_total_num_tokens":
            if not 0 < value < 1e18:  # NaN, a negative or absurd figure: not a pool size
                continue
            tokens, rank = int(value), found.get("dp_rank", "")
        else:
            blocks = _count(found.get("num_gpu_blocks", ""))
            size = _count(found.get("block_size", ""))
            if blocks is None or size is None:
                continue
            tokens, rank = blocks * size, ""
        pools[name, rank] = max(pools.get((name, rank), 0), tokens)
    totals: dict[str, int] = {}
    for (name, _), tokens in pools.items():
        totals[name] = totals.get(name, 0) + tokens
    return max(totals.values(), default=0) or None


def _count(label: str) -> int | None:
    """A label's count, from ASCII digits only: ``isdigit`` alone takes "²", which ``int``
    refuses, and ``int`` refuses 5,000 digits; neither may stop a scrape."""
    if label.isascii() and label.isdigit() and len(label) <= 18:
        return int(label)
    return None


async def scrape_one(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
    names = ENGINE_METRICS.get(replica.config.engine)
    if names is None or not replica.healthy:
        return
    try:
        response = await client.get(replica.url + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return
    if response.status_code != 200:
        return
    try:
        text = response.text
        replica.engine = parse_engine_gauges(text, names, time.monotonic())
        replica.kv_capacity_tokens = parse_kv_capacity(text) or replica.kv_capacity_tokens
    except Exception as exc:  # a backend's answer is untrusted input
        log.debug("unparsable /metrics from %s: %s", replica.name, exc)


async def scrape_loop(
    client: httpx.AsyncClient,
    current: Callable[[], tuple[BackendSet, float]],
    pause: Callable[[], Awaitable[None]],
) -> None:
    """Scrapes all replicas, then ``pause()``s until the next round: the live interval,
    ended early when a reload shortened it (``gateway.pacer.Pacer``)."""
    while True:
        backends, interval = current()
        async with anyio.create_task_group() as group:
            for replica in backends.replicas:
                group.start_soon(scrape_one, client, replica, interval)
        await pause()
