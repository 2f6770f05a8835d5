"""The shipped Grafana dashboard: well-formed, and every query names a metric we export.

The static tests need nothing but the JSON. The ``prometheus`` ones parse every
expression with ``promtool`` and run them through a real Prometheus scraping a
``GatewayMetrics`` fed with synthetic requests, so a blank panel fails here
before any gateway is involved (``test_prometheus_dashboard.py`` repeats the
last check against a live gateway under traffic).
"""

from __future__ import annotations

import random
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from gateway.metrics import GatewayMetrics
from gateway.record import REJECT_REASONS, REQUEST_STATUSES, RequestRecord
from tests.prom import (
    BUILTINS,
    expressions,
    find_binary,
    load_dashboard,
    panels,
    running_prometheus,
    substitute,
    wait_until_no_blank_panel,
)

FUNCTIONS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "histogram_quantile",
    "clamp_min", "clamp_max", "abs", "vector", "scalar", "topk", "bottomk", "sum_over_time",
    "avg_over_time", "max_over_time", "quantile_over_time", "delta", "deriv", "label_replace",
}  # fmt: skip
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset"}  # fmt: skip
VARIABLES = {"pool", "backend", *BUILTINS}


def exported_names() -> dict[str, str]:
    """Sample name -> family name, for every metric GatewayMetrics defines."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    return {
        family.name + suffix: family.name
        for family in registry.collect()
        for suffix in suffixes[family.type]
    }


def check_balanced(expr: str) -> None:
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    in_string = False
    escaped = False
    for char in expr:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "([{":
            stack.append(char)
        elif char in closing:
            assert stack and stack.pop() == closing[char], f"unbalanced {char!r} in {expr}"
    assert not in_string, f"unterminated string in {expr}"
    assert not stack, f"unclosed {stack} in {expr}"


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, found by stripping everything that is not one."""
    check_balanced(expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        name, rest = match.group(0), text[match.end() :].lstrip()
        if rest.startswith("("):
            assert name in FUNCTIONS, f"unknown function {name} in {expr}"
        elif name not in KEYWORDS:
            names.add(name)
    return names


def test_dashboard_layout_is_sound() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "kneecap"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    for panel in panels(dashboard):
        assert panel.get("description", "").strip(), f"{panel['title']}: say what to look for"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_expression_references_only_exported_metrics() -> None:
    exported = exported_names()
    used: set[str] = set()
    for where, expr in expressions(load_dashboard()):
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in VARIABLES, f"{where}: unknown variable ${name}"
        # Multi-value variables expand to a regex: they need =~, not =.
        assert not re.search(r'[^=!~]=\s*"[^"]*\$', expr), f"{where}: use =~ with variables"
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        unknown = names - exported.keys()
        assert not unknown, f"{where}: {sorted(unknown)} not defined by GatewayMetrics"
        used |= {exported[name] for name in names}
    unused = set(exported.values()) - used
    assert not unused, f"metrics no panel shows: {sorted(unused)}"


def test_variable_queries_reference_exported_metrics() -> None:
    exported = exported_names()
    for variable in load_dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            selector = re.match(r"label_values\((.+),\s*\w+\)$", query)
            assert selector, query
            assert metric_names(selector.group(1)) <= exported.keys(), query


@pytest.mark.prometheus
def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    promtool = find_binary("promtool")
    values = {**BUILTINS, "pool": ".*", "backend": "(vllm-0|sglang-0)"}
    rules = [
        {"record": f"kneecap:dashboard_{i}", "expr": substitute(expr, values)}
        for i, (_, expr) in enumerate(expressions(load_dashboard()))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


BACKENDS = {"vllm-0": "short", "vllm-1": "short", "sglang-0": "long"}


def feed(metrics: GatewayMetrics, stop: threading.Event) -> None:
    """Synthetic traffic: what a gateway under load would record, a few hundred times."""
    rng = random.Random(0)
    for name, pool in BACKENDS.items():
        metrics.register_backend(name, pool)
    for pool in set(BACKENDS.values()):
        metrics.register_pool(pool, ["interactive", "batch"])
    for _ in range(3000):  # bounded: about a minute at most
        for name, pool in BACKENDS.items():
            gaps = [rng.uniform(0.005, 0.05) for _ in range(rng.randint(1, 64))]
            metrics.observe_request(
                RequestRecord(
                    backend=name, pool=pool, model="Qwen/Qwen3-4B",
                    status=rng.choices(REQUEST_STATUSES, weights=(90, 4, 1, 2, 2, 2))[0],
                    stream=True, finish_reason="stop", queue_s=(queue := rng.uniform(0, 0.05)),
                    upstream_s=queue + rng.uniform(0.0002, 0.003),
                    overhead_s=rng.uniform(0.0002, 0.003),
                    ttft_s=rng.uniform(0.02, 2.0), itl_s=gaps, e2e_s=rng.uniform(0.5, 5.0),
                    prompt_tokens=rng.randint(10, 20000), completion_tokens=len(gaps),
                )
            )  # fmt: skip
            inflight = rng.randint(0, 16)
            metrics.set_backend_state(name, up=True, inflight=inflight, limit=16)
            metrics.set_engine_stats(
                name, running=inflight, waiting=rng.randint(0, 2), kv_cache_usage=rng.random()
            )
            metrics.set_output_tokens_per_second(name, rng.uniform(100, 2000))
        metrics.observe_rejection("short", rng.choice(REJECT_REASONS))
        metrics.observe_retry("vllm-1")
        metrics.set_queue_depth("short", "interactive", rng.randint(0, 5))
        if stop.wait(0.02):
            return


@pytest.fixture
def synthetic_target() -> Iterator[str]:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(metrics, stop), daemon=True)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    feeder.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        feeder.join()
        thread.join()


@pytest.mark.prometheus
def test_every_dashboard_query_has_data_from_synthetic_metrics(
    tmp_path: Path, synthetic_target: str
) -> None:
    with running_prometheus(tmp_path / "prom", {"kneecap": [synthetic_target]}) as prom:
        prom.wait_for_scrape("kneecap", scrapes=2)
        wait_until_no_blank_panel(prom, timeout=30)
