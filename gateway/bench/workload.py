"""What each benchmark request asks for: prompt length, output length, body.

``--prompt-tokens`` takes either a list of lengths, each run as its own series
(``1024,8192,32768``), or one weighted mix drawn per request
(``1024:0.8,8192:0.15,32768:0.05``). ``--requests-file`` takes JSONL, one
OpenAI request body per line, replayed in order and cycled. Every request is
derived from its index with its own seeded generator, so a sweep replays
identically against two targets (which ``--compare`` relies on).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from backends.sim.tokenizer import count_chat_tokens, count_text_tokens


class WorkloadError(ValueError):
    """A workload option or file is invalid; the message says where."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt_tokens: int  # the target (synthetic) or an estimate (replayed)
    max_tokens: int
    prompt_class: int | None  # synthetic prompt length, groups TTFT by length
    seed: int
    body: Mapping[str, Any] | None = None  # a replayed request; None: synthetic


class Workload(Protocol):
    @property
    def label(self) -> str: ...

    @property
    def prompt_classes(self) -> tuple[int, ...]:
        """The synthetic prompt lengths this workload draws from (none when replayed)."""
        ...

    def spec(self, index: int) -> RequestSpec: ...


@dataclass(frozen=True, slots=True)
class PromptMix:
    lengths: tuple[int, ...]
    weights: tuple[float, ...]  # normalised to sum to 1

    @property
    def label(self) -> str:
        if len(self.lengths) == 1:
            return str(self.lengths[0])
        return ",".join(f"{n}:{w:g}" for n, w in zip(self.lengths, self.weights, strict=True))

    def draw(self, rng: random.Random) -> int:
        if len(self.lengths) == 1:
            return self.lengths[0]
        return rng.choices(self.lengths, self.weights)[0]


def parse_prompt_tokens(text: str) -> list[PromptMix]:
    """``1024,8192`` -> two single-length series; ``1024:0.8,8192:0.2`` -> one mix."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise WorkloadError("--prompt-tokens is empty")
    weighted = [":" in item for item in items]
    if any(weighted) and not all(weighted):
        raise WorkloadError(
            f"--prompt-tokens {text!r}: give weights for every length (1024:0.8,8192:0.2) "
            "or for none (1024,8192 runs each length as its own series)"
        )
    pairs = [_parse_pair(item) for item in items]
    lengths = [n for n, _ in pairs]
    if repeated := sorted({n for n in lengths if lengths.count(n) > 1}):
        # Two series of one length would share a label, and their points one curve.
        raise WorkloadError(
            f"--prompt-tokens {text!r}: {', '.join(map(str, repeated))} given more than once"
        )
    if not all(weighted):
        return [PromptMix((n,), (1.0,)) for n, _ in pairs]
    total = sum(w for _, w in pairs)
    if total <= 0:
        raise WorkloadError(f"--prompt-tokens {text!r}: weights sum to zero")
    if not math.isfinite(total):  # each weight is finite, their sum overflowed
        raise WorkloadError(f"--prompt-tokens {text!r}: weights too large")
    return [PromptMix(tuple(n for n, _ in pairs), tuple(w / total for _, w in pairs))]


def _parse_pair(item: str) -> tuple[int, float]:
    length, _, weight = item.partition(":")
    try:
        n = int(length)
        w = float(weight) if weight else 1.0
    except ValueError:
        raise WorkloadError(
            f"bad prompt length {item!r}: expected TOKENS or TOKENS:WEIGHT"
        ) from None
    if n < 1 or not (math.isfinite(w) and w >= 0):  # NaN compares false to everything
        raise WorkloadError(
            f"bad prompt length {item!r}: tokens >= 1 and weight >= 0 (a finite number)"
        )
    return n, w


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    mix: PromptMix
    output_tokens: int
    seed: int = 0

    @property
    def label(self) -> str:
        return self.mix.label

    @property
    def prompt_classes(self) -> tuple[int, ...]:
        return self.mix.lengths

    def spec(self, index: int) -> RequestSpec:
        seed = self.seed * 1_000_003 + index
        n = self.mix.draw(random.Random(seed))
        return RequestSpec(index, n, self.output_tokens, n, seed)


@dataclass(frozen=True, slots=True)
class ReplayWorkload:
    """Real requests from JSONL, cycled; ``max_tokens`` in a body wins."""

    label: str
    bodies: tuple[Mapping[str, Any], ...]
    output_tokens: int
    seed: int = 0
    prompt_classes: tuple[int, ...] = ()

    def spec(self, index: int) -> RequestSpec:
        body = self.bodies[index % len(self.bodies)]
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or self.output_tokens
        return RequestSpec(
            index, estimate_prompt_tokens(body), int(limit), None, self.seed + index, body
        )


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    if isinstance(body.get("messages"), list):
        return count_chat_tokens(body["messages"], body.get("tools"))  # as the engine counts
    prompt = body.get("prompt")
    return count_text_tokens(prompt) if isinstance(prompt, str) else 0


def load_requests_file(path: Path, output_tokens: int, seed: int = 0) -> ReplayWorkload:
    bodies: list[Mapping[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(body, dict) or not ("messages" in body or "prompt" in body):
            raise WorkloadError(f"{path}:{number}: expected a request body with messages or prompt")
        bodies.append(body)
    if not bodies:
        raise WorkloadError(f"{path}: no requests")
    return ReplayWorkload(path.name, tuple(bodies), output_tokens, seed)


def workloads_from(mixes: Sequence[PromptMix], output_tokens: int, seed: int) -> list[Workload]:
    return [SyntheticWorkload(mix, output_tokens, seed) for mix in mixes]
