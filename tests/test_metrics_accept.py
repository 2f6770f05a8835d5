"""``GET /metrics`` answers whatever ``Accept`` a scraper sends.

prometheus_client (0.26) raises on an OpenMetrics or text Accept whose version it cannot
compare (a ``TypeError``), and the scrape was answered 500: a client's header made the
endpoint fail. A header it cannot read now gets the plain text format, which any
Prometheus-compatible scraper reads.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

MALFORMED = [
    "application/openmetrics-text; version=abc",
    "application/openmetrics-text; version=1.0.0abc",
    "application/openmetrics-text; version=1e3",
    "text/plain; version=x.y",
    "application/json, application/openmetrics-text; version=NaN;q=0.9",
]


def scrape(url: str, accept: str) -> httpx.Response:
    return httpx.get(url + "/metrics", headers={"accept": accept}, timeout=5)


def assert_text_exposition(answer: httpx.Response) -> None:
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    names = {family.name for family in text_families(answer.text)}
    assert "kneecap_requests" in names and "kneecap_backend_up" in names


@pytest.mark.parametrize("accept", MALFORMED)
def test_an_accept_prometheus_client_cannot_read_gets_the_text_format(
    live_gateway: str, accept: str
) -> None:
    assert_text_exposition(scrape(live_gateway, accept))


def test_plain_and_well_formed_openmetrics_accepts_are_still_negotiated(
    live_gateway: str,
) -> None:
    assert_text_exposition(scrape(live_gateway, "text/plain"))
    answer = scrape(live_gateway, "application/openmetrics-text; version=1.0.0")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert answer.text.endswith("# EOF\n")
    names = {family.name for family in openmetrics_families(answer.text)}
    assert "kneecap_requests" in names
