"""The gateway's own TTFT agrees with what the openai client measures; token counts are exact."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx
import openai

from backends.sim.tokenizer import count_chat_tokens
from tests.procs import MODEL, backend, start_gateway, start_sim

REQUESTS = 30
TOKENS = 20


def test_gateway_ttft_matches_the_client_within_3_ms_at_the_median(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=30, itl_ms=10)
    gw = start_gateway(tmp_path, {"backends": [backend("s", sim.url)]})
    messages = [{"role": "user", "content": "How far is the knee? " * 20}]
    try:
        sent: list[float] = []
        # TTFT as the field defines it: from the request being sent to the first output
        # token received; the SDK's own work before sending is not the gateway's.
        http_client = httpx.Client(
            event_hooks={"request": [lambda request: sent.append(time.perf_counter())]}
        )
        client = openai.OpenAI(
            base_url=gw.url + "/v1", api_key="x", max_retries=0, http_client=http_client
        )
        client.models.list()  # connection warm, as in steady traffic
        measured: dict[str, tuple[float, int]] = {}
        for i in range(REQUESTS):
            request_id = f"accuracy-{i}"
            stream = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                max_tokens=TOKENS,
                extra_headers={"x-request-id": request_id},
            )
            first = None
            received = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
                    if first is None:
                        first = time.perf_counter()
            assert first is not None
            measured[request_id] = (first - sent[-1], received)
        recent = httpx.get(gw.url + "/admin/requests?limit=100", timeout=5).json()["requests"]
        by_id = {r["request_id"]: r for r in recent if r["request_id"] in measured}
        assert len(by_id) == REQUESTS
        differences = []
        for request_id, (client_ttft, received) in measured.items():
            record = by_id[request_id]
            assert record["status"] == "ok" and record["finish_reason"] == "length"
            # Exact counts from the backend's usage, which the client never asked for.
            assert record["completion_tokens"] == received == TOKENS
            assert record["prompt_tokens"] == count_chat_tokens(messages)
            assert record["itl_count"] == TOKENS - 1
            differences.append(client_ttft - record["ttft_s"])
        median = statistics.median(differences)
        print(
            f"client TTFT - gateway TTFT: median {median * 1e3:.2f} ms, "
            f"max {max(differences) * 1e3:.2f} ms over {REQUESTS} requests"
        )
        assert abs(median) <= 0.003
    finally:
        gw.proc.stop()
        sim.stop()
