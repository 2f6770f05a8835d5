"""Prompt tokens before routing: calibrated characters per token, or an exact count.

Three ways to count, chosen by ``routing.estimator.mode``:

* ``chars`` (default): characters / (characters per token) + template overhead.
  Characters per token start at a prior (4) and are calibrated per model from
  the exact ``usage.prompt_tokens`` the backends report, so the estimate
  improves as traffic flows (:class:`CharsPerToken`, pure arithmetic).
* ``tokenizer``: exact, with the ``tokenizers`` package on a local
  ``tokenizer.json`` configured per model (:class:`TokenizerFiles`; imported
  lazily, never downloads). Models without one fall back to ``chars``.
* ``backend``: the backend's own ``/tokenize`` (vLLM's API), exact and with
  the real chat template, at the price of a round trip
  (:func:`tokenize_on_backend`; the gateway falls back to ``chars`` on failure).

Chat prompts count every message plus the template's overhead: a fixed number
of tokens per message and per reply (ChatML: ``<|im_start|>role\\n … <|im_end|>``).
An estimate from characters routes; a refusal rests on its floor, the fewest tokens
the prompt can be (:class:`Estimate`), or on an exact count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from policies.prompt_size import PromptShape

# Observations whose text is shorter than this many tokens say more about the
# template than about the text: they do not calibrate.
MIN_CALIBRATION_TOKENS = 16
# Calibrated characters per token are kept within this range (bytes of CJK text
# are ~1 char/token, code and English ~3-5; anything outside is a broken report).
CHARS_PER_TOKEN_RANGE = (0.5, 16.0)


# The most characters one token may cover, for a lower bound from characters alone. The
# calibrated ratio is an average over a model's traffic, not a bound: indented code,
# whitespace runs and separator lines tokenize far sparser (on the CI engine's tokenizer
# 20,000 spaces are 1,252 tokens and 32 dashes one token; CHARS_PER_TOKEN_RANGE's 16 is
# no bound), and a prompt in another script than most is off by ~3x. Larger vocabularies
# hold longer runs still: 128 keeps a refusal from characters to what surely cannot fit.
MOST_CHARS_PER_TOKEN = 128


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class Estimate:
    tokens: int
    exact: bool  # counted by a tokenizer, not estimated from characters
    # The fewest tokens a character estimate may stand for, what decides a refusal: the
    # characters every template renders at MOST_CHARS_PER_TOKEN, and the ids. No template
    # overhead, tool definitions or calls: a template may render none of them as counted.
    floor: int | None = None
    # A batch's longest sequence counted on its own (a tokenizer counts each text): its
    # share of the whole by characters may be far off when the texts tokenize unlike.
    longest: int | None = None
    # The fewest tokens a batch's longest sequence can be, when known better than its share
    # of the floor (a backend counting the whole batch at once).
    longest_floor: int | None = None

    @property
    def fewest(self) -> int:
        return self.tokens if self.floor is None else self.floor

    def longest_likely(self, shape: PromptShape) -> int:
        """The longest sequence as estimated: what routing prefers a context to hold."""
        return self.longest if self.longest is not None else shape.longest_of(self.tokens)

    def longest_fewest(self, shape: PromptShape) -> int:
        """The fewest tokens the longest sequence can be: what a refusal rests on."""
        if self.longest_floor is not None:
            return self.longest_floor
        return self.longest if self.longest is not None else shape.longest_of(self.fewest)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    tokens_per_message: int = 4
    tokens_per_reply: int = 3

    def overhead(self, shape: PromptShape) -> int:
        if not shape.chat:
            return 0
        return self.tokens_per_message * shape.messages + self.tokens_per_reply


@dataclass(slots=True)
class _Calibration:
    chars: float = 0.0  # EWMA of characters per observation
    tokens: float = 0.0  # EWMA of text tokens per observation
    observations: int = 0


class CharsPerToken:
    """Characters-per-token estimator, calibrated per model from exact usage.

    Each observation is a prompt's characters and its text tokens (reported
    prompt tokens less template overhead and token ids). Both are averaged with
    an EWMA of weight ``max(alpha, 1 / n)`` for the n-th observation — a plain
    mean until 1/alpha observations, so the first usage replaces the prior at
    once — and characters per token is their ratio, so long prompts weigh more
    than short ones.
    """

    def __init__(
        self, *, prior: float = 4.0, alpha: float = 0.05, template: ChatTemplate | None = None
    ) -> None:
        self.prior = prior
        self.alpha = alpha
        self.template = template or ChatTemplate()
        self._models: dict[str, _Calibration] = {}

    def chars_per_token(self, model: str) -> float:
        state = self._models.get(model)
        if state is None or state.tokens <= 0:
            return self.prior
        low, high = CHARS_PER_TOKEN_RANGE
        return min(high, max(low, state.chars / state.tokens))

    def observations(self, model: str) -> int:
        state = self._models.get(model)
        return 0 if state is None else state.observations

    def estimate(self, model: str, shape: PromptShape) -> int:
        return self._at(self.chars_per_token(model), shape)

    def estimate_with_floor(self, model: str, shape: PromptShape) -> Estimate:
        """The estimate at the calibrated ratio, to route by, and as its floor the fewest
        tokens the prompt can be, to refuse by (see :class:`Estimate`). A prompt of token
        ids only (no text, no chat template) is counted, not estimated: exact."""
        if not shape.texts and not shape.messages and shape.token_ids:
            return Estimate(shape.token_ids, exact=True)
        floor = shape.rendered_chars // MOST_CHARS_PER_TOKEN + shape.token_ids
        return Estimate(self.estimate(model, shape), exact=False, floor=floor)

    def _at(self, chars_per_token: float, shape: PromptShape) -> int:
        text = shape.chars / chars_per_token
        return round(text) + self.template.overhead(shape) + shape.token_ids

    def observe(self, model: str, shape: PromptShape, prompt_tokens: int) -> bool:
        """Digest one request's exact prompt tokens; False when it says nothing."""
        text_tokens = prompt_tokens - self.template.overhead(shape) - shape.token_ids
        # An image's or audio's tokens would count as the text's, ratio down to the floor.
        if text_tokens < MIN_CALIBRATION_TOKENS or shape.chars <= 0 or shape.media:
            return False
        state = self._models.setdefault(model, _Calibration())
        state.observations += 1
        weight = max(self.alpha, 1.0 / state.observations)
        state.chars += weight * (shape.chars - state.chars)
        state.tokens += weight * (text_tokens - state.tokens)
        return True

    def state(self) -> dict[str, dict[str, float]]:
        """Per model: characters per token and observations (for /admin/state)."""
        return {
            model: {"chars_per_token": self.chars_per_token(model), "observations": s.observations}
            for model, s in self._models.items()
        }


class TokenizerFiles:
    """Exact counts from local ``tokenizer.json`` files, each loaded once, lazily."""

    def __init__(self, template: ChatTemplate | None = None) -> None:
        self.template = template or ChatTemplate()
        self._loaded: dict[str, Any] = {}

    def _tokenizer(self, path: str) -> Any:
        tokenizer = self._loaded.get(path)
        if tokenizer is None:
            from tokenizers import Tokenizer  # optional extra: kneecap[tokenizers]

            tokenizer = Tokenizer.from_file(str(Path(path)))
            self._loaded[path] = tokenizer
        return tokenizer

    def count(self, path: str, shape: PromptShape) -> Estimate:
        tokenizer = self._tokenizer(path)
        texts = list(shape.texts)
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        counts = [len(e.ids) for e in encoded]
        total = sum(counts) + self.template.overhead(shape) + shape.token_ids
        if shape.optional_texts:
            # Tool definitions and calls counted as JSON: what the template makes of them
            # (nothing, with some templates or `tool_choice: "none"`) is unknown here, so
            # only the rest is sure, as for a character estimate (see Estimate.floor).
            rendered = sum(counts[: len(counts) - shape.optional_texts])
            return Estimate(total, exact=False, floor=rendered + shape.token_ids)
        # A batch of texts (a list of prompts or inputs), each its own sequence.
        batch = len(counts) > 1 and not shape.chat and not shape.token_ids
        return Estimate(total, exact=True, longest=max(counts) if batch else None)


@dataclass(frozen=True, slots=True)
class Tokenized:
    count: int
    max_model_len: int | None


async def tokenize_on_backend(
    client: httpx.AsyncClient,
    url: str,
    payload: Mapping[str, Any],
    *,
    headers: Sequence[tuple[bytes, bytes]],
    timeout_s: float,
) -> Tokenized | None:
    """The backend's own count (vLLM ``POST /tokenize``); None when it does not answer."""
    body: dict[str, Any] = {"model": payload["model"]}
    if isinstance(payload.get("messages"), list):
        body["messages"] = payload["messages"]
        if payload.get("tools"):
            body["tools"] = payload["tools"]
    else:
        body["prompt"] = payload.get("prompt", payload.get("input", ""))
    try:
        # A deadline for the whole call: httpx's timeout bounds each read, and a backend
        # dripping its answer a byte at a time would hold the request for far longer.
        with anyio.fail_after(timeout_s):
            response = await client.post(
                url + "/tokenize", json=body, headers=list(headers), timeout=timeout_s
            )
        if response.status_code != 200:
            return None
        answer = response.json()
        count = answer["count"]
    except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError):
        return None
    # The answer is untrusted input: a count that is no count is no answer.
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return None
    length = answer.get("max_model_len")
    usable = isinstance(length, int) and not isinstance(length, bool) and length > 0
    return Tokenized(count, length if usable else None)
