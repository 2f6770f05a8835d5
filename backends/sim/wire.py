"""vLLM's exact OpenAI wire format for the simulated backend (compact JSON, SSE)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from backends.sim.extras import Extras, choice_logprobs
from backends.sim.words import WORDS, token_text, word_of

__all__ = ["WORDS", "token_text", "word_of"]  # the output's words, where they always were


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
    return sse(_chunk_object(ident, model, True, delta, finish, index))


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
    return sse(_chunk_object(ident, model, False, text, finish, index))


_SLOT = "\x00kneecap-token-slot\x00"  # stands for the text while a template is cut


class TokenChunks:
    """One stream's token chunks: bytes equal to :func:`chat_chunk` / :func:`completion_chunk`.

    Within a stream the chunks differ only in the token's text, so each is cut once
    from a real chunk and joined per token instead of being encoded as JSON again. A
    request that asked for more (:mod:`.extras`) has each chunk built whole instead.
    """

    __slots__ = (
        "_after",
        "_before",
        "_chat",
        "_echo",
        "_extras",
        "_ident",
        "_index",
        "_model",
        "_offset",
        "_prompt_tokens",
    )
    _texts = tuple(dumps(word) for word in WORDS)

    def __init__(
        self,
        ident: Identity,
        model: str,
        chat: bool,
        index: int = 0,
        extras: Extras | None = None,
        prompt_tokens: int = 0,
        echo: str = "",
    ) -> None:
        self._ident = ident
        self._model = model
        self._chat = chat
        self._index = index  # the choice's, when a request asked for several
        self._extras = extras or None  # None: the plain path
        self._prompt_tokens = prompt_tokens  # for continuous usage stats
        self._echo = echo  # the prompt's text, before the first token
        self._offset = 0  # a completion's text so far, for its logprobs' text_offset
        slot = dumps(_SLOT)
        self._before, _, self._after = self._make(_SLOT, None).partition(slot)

    def _make(self, text: str, finish: str | None) -> bytes:
        if self._chat:
            return chat_chunk(self._ident, self._model, {"content": text}, finish, self._index)
        return completion_chunk(self._ident, self._model, text, finish, self._index)

    def token(self, seed: int, index: int, finish: str | None) -> bytes:
        if self._extras is not None:
            return self._decorated(self._extras, seed, index, finish)
        if finish is not None:  # the last chunk: once per stream
            return self._make(token_text(seed, index), finish)
        return self._before + self._texts[word_of(seed, index)] + self._after

    def role(self) -> bytes:
        """A chat stream's first chunk for this choice."""
        delta = {"role": "assistant", "content": ""}
        chunk = _chunk_object(self._ident, self._model, True, delta, None, self._index)
        return sse(self._with_usage(chunk, 0))

    def _decorated(self, extras: Extras, seed: int, index: int, finish: str | None) -> bytes:
        text = token_text(seed, index)
        if index == 0:  # vLLM echoes the prompt with the first token
            text = self._echo + text
        delta: Any = {"content": text} if self._chat else text
        chunk = _chunk_object(self._ident, self._model, self._chat, delta, finish, self._index)
        if extras.logprobs is not None:
            tokens = range(index, index + 1)
            echoed = self._echo if index == 0 else ""
            top = extras.logprobs
            logprobs = choice_logprobs(self._chat, seed, tokens, top, self._offset, echoed)
            chunk["choices"][0]["logprobs"] = logprobs
        self._offset += len(text)
        return sse(self._with_usage(chunk, index + 1))

    def _with_usage(self, chunk: dict[str, Any], completion: int) -> dict[str, Any]:
        if self._extras is not None and self._extras.continuous_usage:
            chunk["usage"] = usage(self._prompt_tokens, completion)
        return chunk


def _chunk_object(
    ident: Identity, model: str, chat: bool, delta: Any, finish: str | None, index: int
) -> dict[str, Any]:
    if chat:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
    else:
        choice = _text_choice(delta, finish, index)
    return {
        "id": ident.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": ident.created,
        "model": model,
        "choices": [choice],
    }


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


def full_responses(
    ident: Identity,
    model: str,
    chat: bool,
    answers: list[tuple[str, str | None]],
    usage: dict[str, int],
    logprobs: list[dict[str, Any]] | None = None,
) -> bytes:
    """A non-streamed answer with one choice per (text, finish reason), in index order,
    and each choice's logprobs when the request asked for them."""
    return dumps(
        {
            "id": ident.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": ident.created,
            "model": model,
            "choices": [
                _full_choice(chat, index, text, finish, logprobs[index] if logprobs else None)
                for index, (text, finish) in enumerate(answers)
            ],
            "usage": usage,
        }
    )


def _full_choice(
    chat: bool, index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    if not chat:
        choice = _text_choice(text, finish, index)
        choice["logprobs"] = logprobs
        return choice
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "tool_calls": []},
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": None,
    }
