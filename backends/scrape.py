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
    """The engine's KV cache size in tokens, where its /metrics says it.

    vLLM: ``vllm:cache_config_info`` labels ``num_gpu_blocks`` times ``block_size``;
    SGLang: ``sglang:max_total_num_tokens``. Of several series (ranks) the largest
    counts: tensor-parallel ranks repeat one pool, and under data parallelism
    one rank's size is the safe side.
    """
    largest = 0
    for name, labels, value in samples(text, _CAPACITY_NAMES):
        if name == "sglang:max_total_num_tokens":
            largest = max(largest, int(value))
            continue
        found = dict(_LABEL.findall(labels))
        blocks, size = _count(found.get("num_gpu_blocks", "")), _count(found.get("block_size", ""))
        if blocks is not None and size is not None:
            largest = max(largest, blocks * size)
    return largest or None


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
