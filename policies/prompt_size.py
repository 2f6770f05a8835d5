"""Prompt length estimated without a tokenizer: characters over four.

Good enough to tell a 1K prompt from a 32K one, which is all routing needs;
the context-aware routing refines it per model from observed usage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4


def _text_length(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return 0


def estimate_prompt_tokens(payload: Mapping[str, Any]) -> int:
    messages = payload.get("messages")
    if isinstance(messages, list):
        chars = sum(_text_length(m.get("content")) for m in messages if isinstance(m, Mapping))
        return int(chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * len(messages)
    prompt = payload.get("prompt", payload.get("input"))
    if isinstance(prompt, str):
        return int(len(prompt) / CHARS_PER_TOKEN)
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, int) for p in prompt):
            return len(prompt)  # already token ids
        return sum(
            len(p) if isinstance(p, list) else int(len(str(p)) / CHARS_PER_TOKEN) for p in prompt
        )
    return 0
