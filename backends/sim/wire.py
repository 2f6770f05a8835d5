"""vLLM's exact OpenAI wire format for the simulated backend (compact JSON, SSE)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

WORDS = ("the", " knee", " of", " every", " curve", " is", " where", " latency", " bends", ".")


def word_of(seed: int, index: int) -> int:
    """Which of :data:`WORDS` output token ``index`` of a ``seed`` stream is."""
    return (seed * 31 + index * 7) % len(WORDS)


def token_text(seed: int, index: int) -> str:
    return WORDS[word_of(seed, index)]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Identity:
    """id and created of one response; fixed by the body when the client sends a seed."""

    id: str
    created: int

    @classmethod
    def for_request(cls, prefix: str, payload: dict[str, Any]) -> Identity:
        if isinstance(payload.get("seed"), int):
            # stream_options is left out: a gateway may add it without changing the answer.
            canonical = {k: v for k, v in payload.items() if k != "stream_options"}
            digest = hashlib.sha256(dumps(canonical)).hexdigest()[:24]
            return cls(f"{prefix}-{digest}", 1_700_000_000 + payload["seed"] % 1_000_000)
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()))


def chat_chunk(
    ident: Identity, model: str, delta: dict[str, Any], finish: str | None, index: int = 0
) -> bytes:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    return sse(
        {
            "id": ident.id,
            "object": "chat.completion.chunk",
            "created": ident.created,
            "model": model,
            "choices": [choice],
        }
    )


def _text_choice(text: str, finish: str | None, index: int = 0) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }


def completion_chunk(
    ident: Identity, model: str, text: str, finish: str | None, index: int = 0
) -> bytes:
    choice = _text_choice(text, finish, index)
    return sse(
        {
            "id": ident.id,
            "object": "text_completion",
            "created": ident.created,
            "model": model,
            "choices": [choice],
        }
    )


_SLOT = "\x00kneecap-token-slot\x00"  # stands for the text while a template is cut


class TokenChunks:
    """One stream's token chunks: bytes equal to :func:`chat_chunk` / :func:`completion_chunk`.

    Within a stream the chunks differ only in the token's text, so each is cut once
    from a real chunk and joined per token instead of being encoded as JSON again.
    """

    __slots__ = ("_after", "_before", "_chat", "_ident", "_index", "_model")
    _texts = tuple(dumps(word) for word in WORDS)

    def __init__(self, ident: Identity, model: str, chat: bool, index: int = 0) -> None:
        self._ident = ident
        self._model = model
        self._chat = chat
        self._index = index  # the choice's, when a request asked for several
        slot = dumps(_SLOT)
        self._before, _, self._after = self._make(_SLOT, None).partition(slot)

    def _make(self, text: str, finish: str | None) -> bytes:
        if self._chat:
            return chat_chunk(self._ident, self._model, {"content": text}, finish, self._index)
        return completion_chunk(self._ident, self._model, text, finish, self._index)

    def token(self, seed: int, index: int, finish: str | None) -> bytes:
        if finish is not None:  # the last chunk: once per stream
            return self._make(token_text(seed, index), finish)
        return self._before + self._texts[word_of(seed, index)] + self._after


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def usage_chunk(
    ident: Identity, model: str, object_name: str, prompt: int, completion: int
) -> bytes:
    return sse(
        {
            "id": ident.id,
            "object": object_name,
            "created": ident.created,
            "model": model,
            "choices": [],
            "usage": usage(prompt, completion),
        }
    )


def error(message: str, error_type: str, status: int, param: str | None = None) -> bytes:
    return dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    )


def stream_error(message: str, error_type: str, status: int, param: str | None = None) -> bytes:
    """An error that ends a stream already begun: vLLM spells it with ``json.dumps``'s
    default separators, unlike its chunks."""
    said = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return b"data: " + json.dumps(said).encode() + b"\n\n" + DONE


def full_response(
    ident: Identity, model: str, chat: bool, text: str, finish: str | None, usage: dict[str, int]
) -> bytes:
    """A non-streamed answer: chat.completion or text_completion."""
    return full_responses(ident, model, chat, [(text, finish)], usage)


def full_responses(
    ident: Identity,
    model: str,
    chat: bool,
    answers: list[tuple[str, str | None]],
    usage: dict[str, int],
) -> bytes:
    """A non-streamed answer with one choice per (text, finish reason), in index order."""
    return dumps(
        {
            "id": ident.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": ident.created,
            "model": model,
            "choices": [
                _full_choice(chat, index, text, finish)
                for index, (text, finish) in enumerate(answers)
            ],
            "usage": usage,
        }
    )


def _full_choice(chat: bool, index: int, text: str, finish: str | None) -> dict[str, Any]:
    if not chat:
        return _text_choice(text, finish, index)
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "tool_calls": []},
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }
