"""A real Prometheus for tests, and the dashboard's PromQL as queries it can run.

:func:`running_prometheus` starts the ``prometheus`` binary (Debian's package,
installed by ``.ci/prometheus.sh``) on a free loopback port with a throw-away
config and storage directory, and stops it by PID when the block exits.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kneecap.json"


def find_binary(name: str) -> str:
    """The binary's path; without it a CI run fails (it must install it) and others skip."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        message = f"{name} not found: run .ci/prometheus.sh (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Prometheus:
    """The HTTP API of a running server: instant queries, label values, scrape state."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.process, self.log = url, process, log
        self._http = httpx.Client(base_url=url, timeout=10.0, trust_env=False)

    def _get(self, path: str, params: Mapping[str, str | Sequence[str]]) -> Any:
        response = self._http.get(path, params=params)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {dict(params)}: {body.get('error', response.text)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (a scalar comes back as one element)."""
        data = self._get("/api/v1/query", {"query": expr})
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self._get(f"/api/v1/label/{label}/values", {"match[]": [match]})
        return values

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self._get("/api/v1/targets", {})["activeTargets"]
        return active

    def wait_for_scrape(self, job: str, scrapes: int = 1, timeout: float = 30.0) -> None:
        """Until ``job`` has been scraped successfully ``scrapes`` times."""
        expr = f'sum_over_time(up{{job="{job}"}}[5m]) >= {scrapes}'
        deadline = time.monotonic() + timeout
        while not self.query(expr):
            if time.monotonic() > deadline:
                state = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()]
                raise AssertionError(f"job {job!r}: fewer than {scrapes} scrapes; targets {state}")
            time.sleep(0.2)  # poll interval; the condition is checked above

    def close(self) -> None:
        self._http.close()


def write_config(path: Path, targets: Mapping[str, Sequence[str]], interval: str) -> None:
    jobs = [
        {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
        for job, addresses in targets.items()
    ]
    config = {"global": {"scrape_interval": interval, "scrape_timeout": interval}}
    path.write_text(yaml.safe_dump({**config, "scrape_configs": jobs}))


@contextmanager
def running_prometheus(
    workdir: Path, targets: Mapping[str, Sequence[str]], interval: str = "1s"
) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (job -> ["host:port", ...]) every ``interval``."""
    binary = find_binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    config, log = workdir / "prometheus.yml", workdir / "prometheus.log"
    write_config(config, targets, interval)
    port = _free_port()
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1h",
        "--log.level=warn",
    ]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(prom)
        yield prom
    finally:
        prom.close()
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(prom: Prometheus, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if prom.process.poll() is not None:
            raise AssertionError(f"prometheus exited early:\n{prom.log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{prom.url}/-/ready", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"prometheus not ready in {timeout}s:\n{prom.log.read_text()}")
        time.sleep(0.1)  # poll interval


# -- the dashboard's queries -------------------------------------------------

# What Grafana puts in place of its built-in variables, for a 1 s scrape interval.
BUILTINS = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included, rows excluded."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) for every target of every panel."""
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, values: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"unknown template variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)


def resolve_variables(prom: Prometheus, dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Each query variable as Grafana would fill it with "All" selected, from live data."""
    values = dict(BUILTINS)
    label_values = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        match = label_values.match(query.strip())
        assert match, f"variable {variable['name']}: only label_values(...) is supported"
        selector, label = substitute(match.group(1), values), match.group(2)
        found = prom.label_values(label, selector)
        assert found, f"variable ${variable['name']} ({query}) has no values"
        values[variable["name"]] = variable.get("allValue") or "(" + "|".join(found) + ")"
    return values


def blank_expressions(
    prom: Prometheus, dashboard: Mapping[str, Any], values: Mapping[str, str]
) -> dict[str, str]:
    """Panel target -> why it would draw nothing (no series, or no finite value)."""
    blank: dict[str, str] = {}
    for where, expr in expressions(dashboard):
        result = prom.query(substitute(expr, values))
        finite = [s for s in result if math.isfinite(float(s["value"][1]))]
        if not finite:
            blank[where] = f"{expr} -> {'no series' if not result else 'only NaN/Inf'}"
    return blank


def wait_until_no_blank_panel(prom: Prometheus, timeout: float) -> None:
    """Poll until every dashboard expression has a finite value, or fail listing the blank ones."""
    dashboard = load_dashboard()
    deadline = time.monotonic() + timeout
    while True:
        try:
            blank = blank_expressions(prom, dashboard, resolve_variables(prom, dashboard))
        except AssertionError as exc:  # a variable without values yet, or a query error
            blank = {"(query)": str(exc)}
        if not blank:
            return
        if time.monotonic() > deadline:
            listing = "\n".join(f"  {where}: {why}" for where, why in sorted(blank.items()))
            raise AssertionError(f"{len(blank)} blank dashboard queries:\n{listing}")
        time.sleep(0.5)  # poll interval: data arrives with the next 1 s scrape
