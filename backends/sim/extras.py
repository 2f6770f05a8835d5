"""What a generation request may ask besides its tokens, in vLLM 0.32's shapes: logprobs,
``echo`` of the prompt, and ``stream_options.continuous_usage_stats``.

The logprobs are synthetic but deterministic: a token's are drawn from (seed, index), as
its text is, so a seeded request answers the same numbers every time. The sampled token
always ranks first: vLLM lists it first, then the top alternatives without it, so chat's
``top_logprobs`` holds ``k`` entries and a completion's ``top_logprobs`` dict ``max(k, 1)``.
Only requests that ask pay for any of this: the plain token path never looks here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.sim.tokenizer import BYTES_PER_TOKEN, count_text_tokens
from backends.sim.words import WORDS, word_of

# The alternatives a token's logprobs name: the output's words, then some it never
# samples, enough for vLLM's largest request (max_logprobs 20, and the sampled one).
VOCAB = (
    *WORDS,
    " a",
    " point",
    " load",
    " queue",
    " token",
    " time",
    " grows",
    " slow",
    " fast",
    " limit",
    " rate",
)
_SAMPLED_FLOOR = 0.02  # the sampled token's probability is never above exp(-0.02)


@dataclass(frozen=True, slots=True)
class Extras:
    """``logprobs``: alternatives per token (None: no logprobs; at most vLLM's 20).
    ``echo``: each prompt's text, which its choices' output follows (empty: no echo)."""

    logprobs: int | None = None
    echo: tuple[str, ...] = ()
    continuous_usage: bool = False

    def __bool__(self) -> bool:
        return self.logprobs is not None or bool(self.echo) or self.continuous_usage

    def echoed(self, choice: int, n: int) -> str:
        """The text choice ``choice`` starts with: its prompt's (a prompt has ``n``)."""
        return self.echo[choice // n] if self.echo else ""


PLAIN = Extras()


def ranked(seed: int, index: int, count: int) -> list[tuple[str, float]]:
    """The first ``count`` of output token ``index``'s (token, logprob), the sampled first."""
    return _ranked(VOCAB[word_of(seed, index)], (seed * 131 + index * 17) & 0xFFFF, count)


def _ranked(token: str, mix: int, count: int) -> list[tuple[str, float]]:
    top = -round(_SAMPLED_FLOOR + (mix % 997) / 1000.0, 4)
    others = [word for word in VOCAB if word != token]
    shift = mix % len(others)
    others = others[shift:] + others[:shift]
    entries = [(token, top)]
    entries += [
        (word, round(top - 0.75 * (rank + 1) - (mix >> (rank % 8)) % 13 / 100.0, 4))
        for rank, word in enumerate(others)
    ]
    return entries[:count]


def prompt_tokens(text: str) -> list[str]:
    """An echoed prompt's tokens under the simulator's rule (4 UTF-8 bytes each): each
    character in the token its first byte falls in."""
    pieces = [""] * count_text_tokens(text)
    at = 0
    for char in text:
        pieces[at // BYTES_PER_TOKEN] += char
        at += len(char.encode())
    return pieces


def chat_content(seed: int, index: int, top: int) -> dict[str, Any]:
    """One token's entry of a chat choice's ``logprobs.content``."""
    (token, logprob), *_ = ranked(seed, index, 1)
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode())}
            for t, lp in ranked(seed, index, top)
        ],
    }


def chat_logprobs(seed: int, indices: range, top: int) -> dict[str, Any]:
    return {"content": [chat_content(seed, i, top) for i in indices]}


def completion_logprobs(
    seed: int, indices: range, top: int, offset: int, prompt: str = ""
) -> dict[str, Any]:
    """A completion choice's logprobs for these tokens, the first at ``offset`` in its text.
    An echoed ``prompt`` comes first, as vLLM lists it: its first token has no logprob."""
    steps: list[list[tuple[str, float]]] = []
    for position, piece in enumerate(prompt_tokens(prompt)):
        mix = (position * 7919 + len(piece) * 31) & 0xFFFF
        steps.append(_ranked(piece, mix, max(top, 1)) if position else [(piece, 0.0)])
    steps += [ranked(seed, i, max(top, 1)) for i in indices]
    offsets, logprobs, tokens, tops = [], [], [], []
    for position, entries in enumerate(steps):
        token, logprob = entries[0]
        first_of_prompt = prompt and position == 0
        offsets.append(offset)
        logprobs.append(None if first_of_prompt else logprob)
        tokens.append(token)
        tops.append(None if first_of_prompt else dict(entries))
        offset += len(token)
    return {
        "text_offset": offsets,
        "token_logprobs": logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def choice_logprobs(
    chat: bool, seed: int, indices: range, top: int, offset: int = 0, prompt: str = ""
) -> dict[str, Any]:
    if chat:
        return chat_logprobs(seed, indices, top)
    return completion_logprobs(seed, indices, top, offset, prompt)
