"""``GET /admin/requests?limit=N``: a limit that is no plain decimal number is the client's
mistake (a 400), and a very long one is still a number, not the gateway's failure (a 500)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.procs import MODEL, Gateway, wait_until


def recent(gw: Gateway, limit: str) -> httpx.Response:
    return httpx.get(gw.url + "/admin/requests", params={"limit": limit}, timeout=5)


# "²" and "①" passed str.isdigit() and then failed int(): a 500. "١٢" (Arabic-Indic 12)
# passed both, so a limit that reads as no number in most places was taken.
@pytest.mark.parametrize("limit", ["²", "①", "١٢", "\uff11\uff12", "abc", "-1", "1.5", " 1", ""])
def test_a_limit_that_is_no_ascii_number_is_a_400(gateway: Gateway, limit: str) -> None:
    answer = recent(gateway, limit)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "limit"
    assert "limit must be a non-negative integer" in error["message"]


def test_a_limit_longer_than_int_parses_means_every_record(gateway: Gateway) -> None:
    """Python's int() refuses more than 4300 digits (a ValueError: a 500); a limit that
    large asks for everything kept."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    wait_until(lambda: bool(recent(gateway, "256").json()["requests"]), timeout=10)
    everything = recent(gateway, "256").json()["requests"]
    huge = recent(gateway, "9" * 5000)
    assert huge.status_code == 200, huge.text
    assert huge.json()["requests"] == everything
    padded = recent(gateway, "0" * 5000 + "1")  # still the number 1
    assert padded.status_code == 200, padded.text
    assert padded.json()["requests"] == everything[-1:]
    assert recent(gateway, "0").json()["requests"] == []
