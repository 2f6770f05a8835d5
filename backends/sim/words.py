"""The simulator's output: a seeded stream of words, the same for the same seed."""

from __future__ import annotations

WORDS = ("the", " knee", " of", " every", " curve", " is", " where", " latency", " bends", ".")


def word_of(seed: int, index: int) -> int:
    """Which of :data:`WORDS` output token ``index`` of a ``seed`` stream is."""
    return (seed * 31 + index * 7) % len(WORDS)


def token_text(seed: int, index: int) -> str:
    return WORDS[word_of(seed, index)]
