"""``GET /v1/models`` through the gateway lists what the engines list: their own entries
(owner, creation time, root, context length), not ones the gateway makes up, with the
largest context among the replicas as ``max_model_len``: the longest prompt it routes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.procs import start_gateway, wait_until
from tests.test_ops_robustness import start_ops_backend
from tests.test_proxy_wire import openai_client

MODEL = "Qwen/Qwen3-4B"


def card(max_model_len: int) -> dict:
    return {
        "id": MODEL,
        "object": "model",
        "created": 1_764_000_000,
        "owned_by": "vllm",
        "root": "/models/qwen3-4b",
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [{"id": "modelperm-1", "allow_sampling": True}],
    }


def listing(*cards: dict) -> str:
    return json.dumps({"object": "list", "data": list(cards)})


def test_the_engines_entries_are_listed_with_the_largest_context(tmp_path: Path) -> None:
    short = start_ops_backend(tmp_path, listing(card(8192)))
    long = start_ops_backend(tmp_path, listing(card(32768)))
    try:
        config = {
            "backends": [
                {"name": "short-0", "url": short.url, "pool": "short"},
                {"name": "long-0", "url": long.url, "pool": "long"},
            ],
            "pools": {
                "short": {"max_prompt_tokens": 4096},
                "long": {"min_prompt_tokens": 4096},
            },
        }
        gw = start_gateway(tmp_path, config)
        try:
            wait_until(lambda: all(b["healthy"] for b in gw.state()["backends"]))
            raw = httpx.get(gw.url + "/v1/models", timeout=5).json()
            assert raw["object"] == "list"
            assert raw["data"] == [{**card(8192), "max_model_len": 32768}]
            models = openai_client(gw.url).models.list().data
            assert [(m.id, m.owned_by, m.created) for m in models] == [
                (MODEL, "vllm", 1_764_000_000)
            ]
        finally:
            gw.proc.stop()
    finally:
        short.stop()
        long.stop()


def test_configured_models_without_a_listing_get_an_entry_of_the_gateways(
    tmp_path: Path,
) -> None:
    """Models and context configured, so the backend's listing is never asked for."""
    backend = start_ops_backend(tmp_path, listing())
    try:
        config = {
            "backends": [
                {
                    "name": "b0",
                    "url": backend.url,
                    "pool": "short",
                    "models": ["configured-model"],
                    "max_model_len": 4096,
                }
            ]
        }
        gw = start_gateway(tmp_path, config)
        try:
            wait_until(lambda: all(b["healthy"] for b in gw.state()["backends"]))
            data = httpx.get(gw.url + "/v1/models", timeout=5).json()["data"]
            assert data == [
                {
                    "id": "configured-model",
                    "object": "model",
                    "created": 0,
                    "owned_by": "kneecap",
                    "max_model_len": 4096,
                }
            ]
        finally:
            gw.proc.stop()
    finally:
        backend.stop()


def test_a_context_grown_by_a_redeploy_is_followed_with_models_configured(
    tmp_path: Path,
) -> None:
    """The engine restarts at the same address with a larger --max-model-len: the gateway
    learns it at its next probe (before: learnt once, the old context refused for good)."""
    engine = start_ops_backend(tmp_path, listing(card(4096)))
    port = int(engine.url.rsplit(":", 1)[1])
    config = {
        "backends": [{"name": "v0", "url": engine.url, "models": [MODEL]}],
        "health": {"interval_s": 0.2},
    }
    gw = start_gateway(tmp_path, config)
    try:

        def models_max_len() -> int | None:
            data = httpx.get(gw.url + "/v1/models", timeout=5).json()["data"]
            return data[0].get("max_model_len") if data else None

        wait_until(lambda: models_max_len() == 4096)
        engine.stop()
        engine = start_ops_backend(tmp_path, listing(card(32768)), port=port)
        wait_until(lambda: models_max_len() == 32768)
    finally:
        gw.proc.stop()
        engine.stop()
