"""Request bodies for an OpenAI endpoint, with prompts of an exact token count.

A synthetic prompt is a per-request prefix followed by filler text from the
simulator's tokenizer rule. The prefix holds a random per-run nonce and the
request's index, so no two prompts share a cached prefix, not even across runs
against the same server (a prefix cache would otherwise serve a repeated run's
prefills for free). Under that rule the count is exact by construction;
against a real tokenizer the filler length is fitted per target length with
the target's ``/tokenize``, when it has one.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.sim.tokenizer import (
    BYTES_PER_TOKEN,
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_PER_REPLY,
    text_of_tokens,
)
from gateway.bench.workload import RequestSpec

PREFIX_TOKENS = 4  # sixteen hex digits: four tokens under the 4-bytes-per-token rule
# text_of_tokens cycles through eight words, so seeds equal modulo 8 give the same filler.
FILLER_VARIANTS = 8
FIT_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    path: str  # below the API base, e.g. /chat/completions
    overhead: int  # tokens the endpoint's template adds around the prompt text
    prompt_key: str

    def prompt_part(self, text: str) -> dict[str, Any]:
        if self.prompt_key == "messages":
            return {"messages": [{"role": "user", "content": text}]}
        return {"prompt": text}


ENDPOINTS: dict[str, Endpoint] = {
    "chat": Endpoint(
        "chat", "/chat/completions", CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REPLY, "messages"
    ),
    "completions": Endpoint("completions", "/completions", 0, "prompt"),
}


def endpoint_of(body: Mapping[str, Any]) -> Endpoint:
    return ENDPOINTS["chat"] if "messages" in body else ENDPOINTS["completions"]


@dataclass(slots=True)
class PromptText:
    """Prompt text of a target token count; the filler is sized in bytes so a
    fit against a real tokenizer can move it by less than a token."""

    endpoint: Endpoint
    filler: dict[int, int] = field(default_factory=dict)  # fitted: target -> filler bytes
    nonce: int = field(default_factory=lambda: secrets.randbits(32))
    fillers: dict[tuple[int, int], str] = field(default_factory=dict)  # (bytes, variant)

    def filler_bytes(self, target: int) -> int:
        tokens = target - self.endpoint.overhead - PREFIX_TOKENS
        return max(0, self.filler.get(target, tokens * BYTES_PER_TOKEN))

    def text(self, target: int, index: int, seed: int, filler: int | None = None) -> str:
        size = self.filler_bytes(target) if filler is None else filler
        key = (size, seed % FILLER_VARIANTS)
        body = self.fillers.get(key)
        if body is None:  # built once per length and variant: a request is issued at once
            body = self.fillers[key] = text_of_tokens(-(-size // BYTES_PER_TOKEN), key[1])[:size]
        return f"{self.nonce:08x}{index % 16**8:08x}" + body


@dataclass(frozen=True, slots=True)
class BodyOptions:
    model: str
    endpoint: Endpoint
    ignore_eos: bool = True


def build_body(
    spec: RequestSpec, prompts: PromptText, options: BodyOptions
) -> tuple[str, dict[str, Any]]:
    """The path and the streaming body for one request."""
    if spec.body is not None:
        endpoint = endpoint_of(spec.body)
        body = dict(spec.body)
    else:
        endpoint = options.endpoint
        body = endpoint.prompt_part(prompts.text(spec.prompt_tokens, spec.index, spec.seed))
    body.pop("max_completion_tokens", None)
    body.update(
        model=options.model,
        max_tokens=spec.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    if options.ignore_eos:
        body["ignore_eos"] = True
    return endpoint.path, body


Counter = Callable[[dict[str, Any]], Awaitable[int | None]]


async def fit_prompts(prompts: PromptText, targets: Iterable[int], count: Counter) -> list[str]:
    """Fit the filler length of each target with ``count``; returns what was found.

    ``count`` returns the target's token count of a prompt part, or ``None``
    when the target cannot tokenize; the counts are then estimates.
    """
    notes: list[str] = []
    for target in sorted(set(targets)):
        k = prompts.filler_bytes(target)
        slope = 1.0 / BYTES_PER_TOKEN  # tokens per filler byte, refined by secant
        seen: tuple[int, int] | None = None
        best: tuple[int, int] | None = None  # (filler bytes, count) closest to the target
        for _ in range(FIT_ROUNDS):
            counted = await count(prompts.endpoint.prompt_part(prompts.text(target, 0, 0, k)))
            if counted is None:
                return ["prompt token counts estimated (the target has no /tokenize)"]
            if best is None or abs(counted - target) < abs(best[1] - target):
                best = (k, counted)
            if counted == target:
                break
            if seen is not None and counted != seen[1] and k != seen[0]:
                slope = max(0.01, (counted - seen[1]) / (k - seen[0]))
            seen = (k, counted)
            k = max(0, k + round((target - counted) / slope))
        assert best is not None
        prompts.filler[target] = best[0]
        off = "" if best[1] == target else f" (closest fit; off by {best[1] - target:+d})"
        notes.append(f"{target}-token prompts: /tokenize counts {best[1]}{off}")
    return notes
