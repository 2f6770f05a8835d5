"""The simulator's tokenizer rule: one token per 4 UTF-8 bytes, rounded up.

Deterministic and cheap, so the benchmark can build prompts of an exact token
count and the gateway's characters-per-token estimator has a ground truth to
converge to. Chat prompts add a fixed template overhead like a real chat
template does, and count what a chat template renders besides the messages' text: the
tool definitions and each assistant message's tool calls, as their JSON (vLLM renders
them into the prompt with the template's ``tojson``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4  # <|im_start|>role\n ... <|im_end|>\n
CHAT_TOKENS_PER_REPLY = 3  # <|im_start|>assistant\n


def count_text_tokens(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def _json_tokens(value: Any) -> int:
    """A template's ``tojson`` of ``value``: nothing when there is none."""
    if not value:
        return 0
    return count_text_tokens(json.dumps(value, ensure_ascii=False))


def count_chat_tokens(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> int:
    """Raises TypeError or AttributeError for a message that is no object, and
    UnicodeEncodeError for a lone surrogate: the callers answer these 400."""
    total = CHAT_TOKENS_PER_REPLY + _json_tokens(tools)
    for message in messages:
        content = count_text_tokens(_content_text(message.get("content")))
        total += CHAT_TOKENS_PER_MESSAGE + content + _json_tokens(message.get("tool_calls"))
    return total


def text_of_tokens(n: int, seed: int = 0) -> str:
    """A prompt of exactly ``n`` tokens under this rule (4 ASCII bytes each)."""
    words = ("lore", "ipsu", "dolo", "sita", "amet", "cons", "ecte", "adip")
    return "".join(words[(i * 7 + seed) % len(words)] for i in range(n))
