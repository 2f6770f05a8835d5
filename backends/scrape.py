"""Scrapes each backend engine's own /metrics for its load gauges.

The values land on the replica's live state (for policies) with the time they
were read; consumers treat them as absent once older than the staleness limit.
An engine without /metrics (404, or an ``openai`` backend) is left alone: the
gateway's own in-flight counts stand in for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from backends.engines import ENGINE_METRICS, EngineMetricNames
from backends.pool import BackendSet
from backends.replica import EngineGauges, Replica

log = logging.getLogger("kneecap.scrape")


def parse_engine_gauges(text: str, names: EngineMetricNames, now: float) -> EngineGauges:
    wanted = set(names.running + names.waiting + names.kv_usage)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                # Several engines (data-parallel ranks) report one series each.
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value

    def first(candidates: tuple[str, ...]) -> float | None:
        return next((totals[n] for n in candidates if n in totals), None)

    return EngineGauges(
        running=first(names.running),
        waiting=first(names.waiting),
        kv_usage=first(names.kv_usage),
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
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    largest = max(largest, int(blocks) * int(size))
            elif sample.name == "sglang:max_total_num_tokens":
                largest = max(largest, int(sample.value))
    return largest or None


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
        replica.engine = parse_engine_gauges(response.text, names, time.monotonic())
        replica.kv_capacity_tokens = parse_kv_capacity(response.text) or replica.kv_capacity_tokens
    except ValueError as exc:
        log.debug("unparsable /metrics from %s: %s", replica.name, exc)


async def scrape_loop(
    client: httpx.AsyncClient,
    current: Callable[[], tuple[BackendSet, float]],
    after_round: Callable[[], None],
) -> None:
    """Every ``interval`` seconds (read from the live config), scrape all replicas."""
    while True:
        backends, interval = current()
        async with anyio.create_task_group() as group:
            for replica in backends.replicas:
                group.start_soon(scrape_one, client, replica, interval)
        after_round()
        await anyio.sleep(interval)
