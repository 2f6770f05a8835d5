"""A proxied request's body: JSON, an object, with the fields its endpoint cannot do without."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest

_DECODER = json.JSONDecoder()

# What each endpoint cannot do without, besides `model`: one of these fields. vLLM takes a
# completion's prompt as `prompt_embeds` too, and an embedding's input as chat `messages`.
REQUIRED_FIELD = {
    "/v1/chat/completions": ("messages",),
    "/v1/completions": ("prompt", "prompt_embeds"),
    "/v1/embeddings": ("input", "messages"),
}


def utf8_object(body: bytes) -> bool:
    """Whether the body is, by its first two bytes, a JSON object in UTF-8: what
    ``json.detect_encoding`` reads of it (no BOM begins with ``{``; in UTF-16 and UTF-32
    the next byte is 0), without its call and checks on every request's path."""
    return body[:1] == b"{" and body[1:2] != b"\x00"


def load_json(body: bytes) -> Any:
    """The body as JSON, or 400 ``invalid_json``."""
    try:
        if utf8_object(body):  # as json.loads decodes bytes, less its encoding detection
            return _DECODER.decode(body.decode("utf-8", "surrogatepass"))
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # json's decoder recurses once per level of nesting
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from exc


def parse_payload(body: bytes, endpoint: str) -> dict[str, Any]:
    payload = load_json(body)
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    if _missing(payload, "model"):
        raise _required(("model",))
    alternatives = REQUIRED_FIELD[endpoint]
    if all(_missing(payload, field) for field in alternatives):
        raise _required(alternatives)
    if not isinstance(payload["model"], str):
        raise InvalidRequest("`model` must be a string", param="model", code="invalid_type")
    if not isinstance(payload.get("stream", False), bool | None):
        # Relayed as given, 1 or "true" would have the engine stream what the gateway
        # reads as one answer, untimed and without its usage.
        raise InvalidRequest("`stream` must be a boolean", param="stream", code="invalid_type")
    if endpoint == "/v1/chat/completions" and not isinstance(payload["messages"], list):
        raise InvalidRequest("`messages` must be an array", param="messages", code="invalid_type")
    return payload


def _missing(payload: dict[str, Any], field: str) -> bool:
    return payload.get(field) in (None, "", [])


def _required(alternatives: tuple[str, ...]) -> InvalidRequest:
    fields = " or ".join(f"`{field}`" for field in alternatives)
    return InvalidRequest(
        f"you must provide the {fields} parameter",
        param=alternatives[0],
        code="missing_required_parameter",
    )
