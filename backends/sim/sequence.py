"""One request's life inside the simulated engine, and its seeded EOS draw."""

from __future__ import annotations

import math
import random
from enum import IntEnum
from typing import Protocol

from backends.sim.base import FinishReason, GenerationRequest, TokenEvent

# Mean length of an answer that stops on its own (EOS) when ignore_eos is
# off: chat answers of a few hundred tokens. A geometric draw, so short and
# long answers mix as they do in real traffic.
MEAN_NATURAL_OUTPUT_TOKENS = 512


class TokenSink(Protocol):
    def __call__(self, now: float, event: TokenEvent, /) -> None: ...


class Phase(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    DONE = 3


def draw_output_length(request: GenerationRequest, engine_seed: int) -> tuple[int, FinishReason]:
    """How many tokens the request will produce and why it will stop.

    Depends only on (engine seed, request seed) so a request replays exactly.
    """
    if request.ignore_eos:
        return request.max_tokens, "length"
    u = random.Random(engine_seed * 1_000_003 + request.seed).random()
    natural = 1 + int(math.log1p(-u) / math.log1p(-1.0 / MEAN_NATURAL_OUTPUT_TOKENS))
    if natural <= request.max_tokens:
        return natural, "stop"
    return request.max_tokens, "length"


class Sequence:
    """Mutable scheduler state of one request.

    KV bookkeeping: a decoding sequence holds ``prompt + generated - 1`` KV
    tokens (the last sampled token is written by the next step). While it
    decodes without interruption its KV size is ``ctx0 + (d - d0)`` at the
    scheduler's decode-step counter ``d``, so nothing per sequence has to be
    touched per step.
    """

    __slots__ = (
        "ctx0",
        "d0",
        "emit",
        "finish_reason",
        "finish_step",
        "generated",
        "max_tokens",
        "phase",
        "prefill_blocks",
        "prefill_computed",
        "prefill_len",
        "prompt",
        "request_id",
        "residue",
        "serial",
        "slot",
        "stop",
    )

    def __init__(self, request: GenerationRequest, emit: TokenSink, engine_seed: int) -> None:
        self.request_id = request.request_id
        self.emit = emit
        self.prompt = request.prompt_tokens
        self.max_tokens = request.max_tokens
        self.stop, self.finish_reason = draw_output_length(request, engine_seed)
        self.generated = 0
        self.phase = Phase.WAITING
        self.prefill_len = request.prompt_tokens  # prompt + generated after a preemption
        self.prefill_computed = 0
        self.prefill_blocks = 0
        self.serial = -1  # admission order; the newest is preempted first
        self.ctx0 = 0
        self.d0 = 0
        self.residue = 0
        self.finish_step = -1
        self.slot = -1  # index in the scheduler's emit list

    def base(self) -> int:
        """Token index emitted by decode step ``d`` is ``d + 1 - base()``."""
        return self.d0 - self.generated + 1
