"""What a request's prompt is made of, read from its JSON body without a tokenizer.

:func:`shape_of` finds the text a chat template or a completion prompt carries
(every message's content, tool definitions, a prompt string or list; ``messages`` on
any endpoint, as vLLM's chat embeddings take them) and any prompt that is already
token ids, and how many sequences the engine runs for it. A prompt given as
``prompt_embeds`` (tensors) shows no size: its shape is empty, and nothing refuses it.
The estimators (``gateway.tokens``) turn a :class:`PromptShape` into tokens;
:func:`output_tokens`, once per sequence, is the other half of a request's KV cost.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class PromptShape:
    texts: tuple[str, ...]  # the text to tokenize: message contents, tools, prompts
    messages: int  # chat messages (each adds template overhead); 0 for completions
    token_ids: int  # prompt tokens given as ids, counted exactly
    # How many of ``texts``, at their end, a chat template may leave out or rewrite: the tool
    # definitions (a template may not render them, some not with ``tool_choice: "none"``)
    # and the JSON of tool calls (rendered in the template's own words). Only the rest
    # surely counts.
    optional_texts: int = 0
    # A list of prompts or inputs is a batch of sequences, each with its own context: the
    # longest one's size and the whole's (characters, or ids when they are ids). Whole
    # numbers, not their ratio: a float ratio turns 2,047 of 2,214 ids into 2,047.0000000000002.
    longest_size: int = 1
    total_size: int = 1
    media: bool = False  # images or audio: tokens the text does not show
    # Sequences the engine runs: each prompt of a batch, ``n`` (or ``best_of``) times. Each
    # has an output of its own; the copies of one prompt share its KV (prefix caching).
    sequences: int = 1

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.texts)

    @property
    def rendered_chars(self) -> int:
        """The characters every template renders: what a lower bound may count on."""
        return sum(len(t) for t in self.texts[: len(self.texts) - self.optional_texts])

    @property
    def chat(self) -> bool:
        return self.messages > 0

    def longest_of(self, tokens: int) -> int:
        """The longest sequence's share of ``tokens`` counted for the whole, rounded up:
        for a batch of ids counted exactly, exactly the longest one's ids."""
        return -(-tokens * self.longest_size // self.total_size)


def _content_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):  # content parts; images and audio are not counted
        parts = (p for p in content if isinstance(p, Mapping))
        return [p["text"] for p in parts if isinstance(p.get("text"), str)]
    return []


def _has_media(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(p, Mapping) and p.get("type", "text") != "text" for p in content
    )


def _longest_and_total(sizes: list[int]) -> tuple[int, int]:
    total = sum(sizes)
    return (max(sizes), total) if total else (1, 1)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def shape_of(payload: Mapping[str, Any]) -> PromptShape:
    # Sampling params: each prompt runs n times (best_of, where an engine honours it: the
    # larger is what it may generate). Values that are no count are the engine's to refuse.
    copies = max(_count(payload.get("n")), _count(payload.get("best_of")))
    messages = payload.get("messages")
    if isinstance(messages, list):
        texts: list[str] = []
        optional: list[str] = []
        media = False
        for message in messages:
            # JSON's objects are dicts: the exact type is checked first, before the
            # abstract class's slower check.
            if type(message) is dict or isinstance(message, Mapping):
                content = message.get("content")
                if isinstance(content, str):  # the common case: plain text, no media
                    texts.append(content)
                else:
                    texts += _content_texts(content)
                    media = media or _has_media(content)
                if message.get("tool_calls"):
                    optional.append(json.dumps(message["tool_calls"], ensure_ascii=False))
        if payload.get("tools"):
            optional.append(json.dumps(payload["tools"], ensure_ascii=False))
        return PromptShape(
            (*texts, *optional),
            max(1, len(messages)),
            0,
            optional_texts=len(optional),
            media=media,
            sequences=copies,
        )
    prompt = payload.get("prompt", payload.get("input"))
    if isinstance(prompt, str):
        return PromptShape((prompt,), 0, 0, sequences=copies)
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, int) for p in prompt):
            return PromptShape((), 0, len(prompt), sequences=copies)  # one prompt of token ids
        texts = [p for p in prompt if isinstance(p, str)]
        id_lists = [p for p in prompt if isinstance(p, list)]
        ids = sum(map(len, id_lists))
        # Strings or id lists, each its own sequence; mixed, the whole is taken as one.
        longest, total = 1, 1
        if texts and not id_lists:
            longest, total = _longest_and_total([len(t) for t in texts])
        elif id_lists and not texts:
            longest, total = _longest_and_total([len(i) for i in id_lists])
        prompts = max(1, len(texts) + len(id_lists))
        return PromptShape(
            tuple(texts),
            0,
            ids,
            longest_size=longest,
            total_size=total,
            sequences=prompts * copies,
        )
    return PromptShape((), 0, 0, sequences=copies)


def output_tokens(payload: Mapping[str, Any], default: int) -> int:
    """The most output tokens the request may produce: its own bound, else ``default``."""
    for field in ("max_completion_tokens", "max_tokens"):
        value = payload.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default
