"""A request the engine runs as several sequences: ``n`` > 1, or a list of prompts on
``/v1/completions``, as vLLM 0.32 serves them.

vLLM submits each prompt as its own request and each of its ``n`` copies as a child
sequence; they batch with everything else, each draws its own end, and the choice
they answer is numbered ``prompt * n + copy``. Here each is one engine sequence of its
own seed (the request's plus its choice index: choice 0 is what the same request with
``n`` = 1 answers, the others differ). The engine has no prefix cache, so every copy
prefills its prompt in full where vLLM, with prefix caching on, computes it once.

The HTTP face races these answers against the client's disconnect, which frees every
sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from backends.sim import wire
from backends.sim.base import AsyncEngine, GenerationRequest, TokenEvent, TokenIterator
from backends.sim.extras import choice_logprobs
from backends.sim.validate import Asked


def sequences(asked: Asked, request_id: str, seed: int) -> list[GenerationRequest]:
    """One request per (prompt, copy), in choice order."""
    prompts = asked.prompts or ((asked.prompt_tokens, asked.max_tokens),)
    return [
        GenerationRequest(
            request_id=f"{request_id}-{p * asked.n + copy}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            ignore_eos=asked.ignore_eos,
            seed=seed + p * asked.n + copy,
        )
        for p, (prompt_tokens, max_tokens) in enumerate(prompts)
        for copy in range(asked.n)
    ]


def prompt_tokens(asked: Asked) -> int:
    """What usage counts as the prompt: each prompt once, however many copies it has."""
    return sum(tokens for tokens, _ in asked.prompts) if asked.prompts else asked.prompt_tokens


class Merged:
    """The tokens of several sequences as the engine emits them: (choice, event).

    One task per sequence feeds a queue, as vLLM merges its per-prompt generators;
    each task owns its sequence and frees it when it ends, however it ends.
    """

    def __init__(self, streams: list[TokenIterator]) -> None:
        self._queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._live = len(streams)

    async def _pump(self, choice: int, tokens: TokenIterator) -> None:
        put = self._queue.put_nowait
        try:
            async for event in tokens:
                put((choice, event))
            put((choice, None))
        except Exception as exc:  # the reader raises it
            put((choice, exc))
        finally:
            await tokens.aclose()  # cancels the sequence unless it ended

    def __aiter__(self) -> Merged:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        while self._live:
            choice, item = await self._queue.get()
            if isinstance(item, TokenEvent):
                return choice, item
            self._live -= 1
            if item is not None:
                raise item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop every sequence still running, and wait until each is freed."""
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


async def start(
    engine: AsyncEngine, gens: list[GenerationRequest], arrival: float | None
) -> Merged:
    """Submit every sequence at once; ValueError, none left running, if one can never fit."""
    streams: list[TokenIterator] = []
    try:
        for gen in gens:
            streams.append(engine.generate(gen, arrival))
    except ValueError:
        for submitted in streams:
            await submitted.aclose()
        raise
    return Merged(streams)


async def stream(
    merged: Merged,
    asked: Asked,
    ident: wire.Identity,
    model: str,
    chat: bool,
    seeds: list[int],
    send: Callable[[bytes], Awaitable[None]],
) -> bytes:
    """Send each chunk as its token comes; returns the bytes left to send last (the
    final choice's finishing chunk, the usage chunk, ``[DONE]``), for one write."""
    extras = asked.extras
    chunks = [
        wire.TokenChunks(
            ident,
            model,
            chat,
            index,
            extras,
            _prompt_of(asked, index),
            extras.echoed(index, asked.n),
        )
        for index in range(len(seeds))
    ]
    pending = len(seeds)
    completion = 0
    last = b""
    try:
        if chat:  # vLLM's role chunks: one per choice, before any content
            for index in range(asked.n):
                await send(chunks[index].role())
        async for choice, event in merged:
            completion += 1
            chunk = chunks[choice].token(seeds[choice], event.index, event.finish_reason)
            if event.finish_reason is not None:
                pending -= 1
                if not pending:
                    last = chunk
                    continue
            await send(chunk)
    finally:
        await merged.aclose()  # the client may have gone: free every sequence
    if asked.include_usage:
        name = "chat.completion.chunk" if chat else "text_completion"
        last += wire.usage_chunk(ident, model, name, prompt_tokens(asked), completion)
    return last + wire.DONE


async def complete(
    merged: Merged, asked: Asked, ident: wire.Identity, model: str, chat: bool, seeds: list[int]
) -> bytes:
    """The whole answer: every choice in index order, usage summed."""
    texts: list[list[str]] = [[] for _ in seeds]
    finishes: list[str | None] = [None] * len(seeds)
    try:
        async for choice, event in merged:
            texts[choice].append(wire.token_text(seeds[choice], event.index))
            finishes[choice] = event.finish_reason
    finally:
        await merged.aclose()  # the client may have gone: free every sequence
    extras = asked.extras
    echoes = [extras.echoed(choice, asked.n) for choice in range(len(seeds))]
    answers = [
        (echo + "".join(parts), finish)
        for echo, parts, finish in zip(echoes, texts, finishes, strict=True)
    ]
    usage = wire.usage(prompt_tokens(asked), sum(len(parts) for parts in texts))
    logprobs = None
    if extras.logprobs is not None:
        logprobs = [
            choice_logprobs(chat, seed, range(len(parts)), extras.logprobs, 0, echo)
            for seed, parts, echo in zip(seeds, texts, echoes, strict=True)
        ]
    return wire.full_responses(ident, model, chat, answers, usage, logprobs)


def _prompt_of(asked: Asked, choice: int) -> int:
    """The prompt tokens of the prompt choice ``choice`` answers."""
    return asked.prompts[choice // asked.n][0] if asked.prompts else asked.prompt_tokens
