"""The simulator's tokenizer rule: one token per 4 UTF-8 bytes, rounded up.

Deterministic and cheap, so the benchmark can build prompts of an exact token
count and the gateway's characters-per-token estimator has a ground truth to
converge to. Chat prompts add a fixed template overhead like a real chat
template does.
"""

from __future__ import annotations

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


def count_chat_tokens(messages: Iterable[Mapping[str, Any]]) -> int:
    total = CHAT_TOKENS_PER_REPLY
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE + count_text_tokens(_content_text(message.get("content")))
    return total


def text_of_tokens(n: int, seed: int = 0) -> str:
    """A prompt of exactly ``n`` tokens under this rule (4 ASCII bytes each)."""
    words = ("lore", "ipsu", "dolo", "sita", "amet", "cons", "ecte", "adip")
    return "".join(words[(i * 7 + seed) % len(words)] for i in range(n))
