"""The step-based continuous-batching scheduler: pure, no clock.

One call to :meth:`Scheduler.schedule` plans one engine iteration and returns
its duration from the cost model; :meth:`Scheduler.commit` completes it at a
time the caller supplies and emits the tokens. Two batching styles:

* ``mixed`` (vLLM V1): every running sequence decodes one token and the rest
  of the per-step token budget goes to (chunked) prefill of partially
  prefilled and then waiting requests; a request is admitted when KV blocks
  for its first chunk are free, otherwise it waits (first come, first
  served). When decode growth finds no free block the newest running
  request is preempted: its KV is freed and it recomputes later.
* ``prefill_first`` (SGLang): a step is either a prefill batch (up to the
  chunk size, decoding pauses) or a decode step. Admission reserves KV for
  ``ratio * (max_tokens - generated)`` of every running request; the ratio
  starts high, decays with every decode step and resets on a retraction.

Speed matters (an hour of traffic must simulate in seconds), so steady
decode touches no per-sequence state except to hand out its token: KV sizes,
block boundaries and finish steps follow from a decode-step counter (see
:class:`backends.sim.sequence.Sequence`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from backends.sim.base import EngineStats, GenerationRequest, TokenEvent
from backends.sim.costmodel import StepCost, prefill_pairs
from backends.sim.sequence import Phase, Sequence, TokenSink

Batching = Literal["mixed", "prefill_first"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    token_budget: int  # tokens per step (vLLM max_num_batched_tokens, SGLang chunk size)
    max_seqs: int
    block_size: int  # KV tokens per block (vLLM 16, SGLang 1)
    kv_blocks: int
    batching: Batching
    reserve_init: float = 0.0  # SGLang new_token_ratio; 0 disables reservation
    reserve_min: float = 0.0
    reserve_decay: float = 0.0  # per decode step


def _noop(now: float, event: TokenEvent, /) -> None:
    """Stands in for a sequence cancelled while its step's tokens go out."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, cost: StepCost, *, seed: int = 0) -> None:
        self.config = config
        self._cost = cost
        self._seed = seed
        self._bs = config.block_size
        self._seqs: dict[str, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by admission serial, oldest first
        self._prefilling: dict[int, Sequence] = {}
        self._decoders: dict[int, Sequence] = {}
        self._bucket = [0] * self._bs  # decoders needing a new block when d % bs == r
        self._finish_at: dict[int, list[Sequence]] = {}
        self._emit: list[tuple[TokenSink, int]] | None = None  # None: rebuild
        self._events: list[TokenEvent] = []
        self._serial = 0
        self._d = 0  # decode steps scheduled so far
        self._sum_ctx = 0  # KV tokens held by decoders
        self._used = 0  # KV blocks in use
        self._rem_dec = 0  # sum of (max_tokens - gen0 + d0) over decoders
        self._rem_pre = 0  # sum of (max_tokens - generated) over prefilling
        self._ratio = config.reserve_init
        self._step_decodes = False
        self._step_prefills: list[tuple[Sequence, bool]] = []
        self._preempted = False  # in this step: admit nobody new (as vLLM V1)
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests ---------------------------------------------------------

    def add(self, request: GenerationRequest, emit: TokenSink) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.max_tokens < 1 or request.prompt_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if self._blocks(request.prompt_tokens + request.max_tokens) > self.config.kv_blocks:
            raise ValueError("prompt plus max_tokens exceeds the whole KV cache")
        seq = Sequence(request, emit, self._seed)
        self._seqs[seq.request_id] = seq
        self._waiting.append(seq)

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV at once; False if it was unknown or done."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.phase == Phase.WAITING:
            self._waiting.remove(seq)
        else:
            self._release(seq)
        seq.phase = Phase.DONE
        return True

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=self._used / self.config.kv_blocks,
            preemptions_total=self.preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    # -- planning -----------------------------------------------------------

    def schedule(self) -> float | None:
        """Plan the next step; its duration, or None when nothing can run."""
        self._step_prefills = []
        self._step_decodes = False
        self._preempted = False
        budget = self.config.token_budget
        if self.config.batching == "prefill_first" and (self._prefilling or self._waiting):
            tokens, kv_read, pairs = self._plan_prefill(budget)
            if tokens:
                return self._cost.step_time(tokens, kv_read, pairs)
        tokens = kv_read = 0
        if self._decoders:
            tokens, kv_read = self._plan_decode()
        pairs = 0.0
        if self.config.batching == "mixed" and (self._prefilling or self._waiting):
            chunk_tokens, chunk_read, pairs = self._plan_prefill(budget - tokens)
            tokens += chunk_tokens
            kv_read += chunk_read
        if not tokens:
            return None
        return self._cost.step_time(tokens, kv_read, pairs)

    def _plan_decode(self) -> tuple[int, int]:
        need = self._bucket[self._d % self._bs]
        if need > self.config.kv_blocks - self._used:
            need = self._make_room(need)
        n = len(self._decoders)
        self._used += need
        kv_read = self._sum_ctx + n
        self._sum_ctx = kv_read
        self._d += 1
        self._step_decodes = n > 0
        if self._ratio > self.config.reserve_min:
            self._ratio = max(self.config.reserve_min, self._ratio - self.config.reserve_decay)
        return n, kv_read

    def _make_room(self, need: int) -> int:
        """Preempt the newest running requests until ``need`` blocks are free."""
        r = self._d % self._bs
        while need > self.config.kv_blocks - self._used:
            victim = self._running[next(reversed(self._running))]
            if victim.phase == Phase.DECODE and victim.residue == r:
                need -= 1
            self._preempt(victim)
        self._ratio = self.config.reserve_init
        return need

    def _plan_prefill(self, budget: int) -> tuple[int, int, float]:
        tokens = kv_read = 0
        pairs = 0.0
        for seq in list(self._prefilling.values()):
            if budget <= 0:
                break
            if seq.phase != Phase.PREFILL:  # preempted to make room for an older one
                continue
            chunk = self._fit_chunk(seq, budget)
            if chunk:
                start = seq.prefill_computed
                self._take_chunk(seq, chunk)
                tokens += chunk
                kv_read += start
                pairs += prefill_pairs(start, chunk)
                budget -= chunk
        while (
            budget > 0
            and self._waiting
            and len(self._running) < self.config.max_seqs
            and not self._preempted
        ):
            seq = self._waiting[0]
            chunk = min(seq.prefill_len, budget)
            free = self.config.kv_blocks - self._used
            if self._blocks(chunk) > free or not self._reserve_allows(seq, free):
                break
            self._waiting.popleft()
            self._admit(seq)
            self._take_chunk(seq, chunk)
            tokens += chunk
            pairs += prefill_pairs(0, chunk)
            budget -= chunk
        return tokens, kv_read, pairs

    def _fit_chunk(self, seq: Sequence, budget: int) -> int:
        """Largest next chunk whose blocks can be had, preempting newer prefills."""
        chunk = min(seq.prefill_len - seq.prefill_computed, budget)
        while True:
            extra = self._blocks(seq.prefill_computed + chunk) - seq.prefill_blocks
            free = self.config.kv_blocks - self._used
            if extra <= free:
                return chunk
            newest = self._running[next(reversed(self._running))]
            if newest is seq or newest.phase != Phase.PREFILL:
                # Take what fits; decoders will finish and free the rest.
                return max(0, (seq.prefill_blocks + free) * self._bs - seq.prefill_computed)
            self._preempt(newest)

    def _reserve_allows(self, seq: Sequence, free_blocks: int) -> bool:
        if not self._ratio or not self._running:
            return True
        remaining = self._rem_dec - len(self._decoders) * self._d + self._rem_pre
        free_tokens = free_blocks * self._bs - self._ratio * remaining
        return free_tokens >= seq.prefill_len + self._ratio * (seq.max_tokens - seq.generated)

    def _take_chunk(self, seq: Sequence, chunk: int) -> None:
        seq.prefill_computed += chunk
        blocks = self._blocks(seq.prefill_computed)
        self._used += blocks - seq.prefill_blocks
        seq.prefill_blocks = blocks
        self._step_prefills.append((seq, seq.prefill_computed == seq.prefill_len))

    # -- completion ---------------------------------------------------------

    def commit(self, now: float) -> None:
        """Complete the planned step at ``now``: emit its tokens, retire finished requests."""
        if self._step_decodes:
            self._commit_decode(now)
        for seq, completes in self._step_prefills:
            if completes and seq.phase == Phase.PREFILL:
                self._complete_prefill(seq, now)
        self._step_prefills = []

    def _commit_decode(self, now: float) -> None:
        step = self._d - 1
        finals: list[Sequence] = []
        for seq in self._finish_at.pop(step, ()):
            if seq.phase == Phase.DECODE and seq.finish_step == step:
                finals.append(seq)
                self._retire(seq)
        emit = self._emit
        if emit is None:
            emit = self._emit = self._build_emit()
        events = self._events
        d = self._d
        self.generation_tokens_total += len(emit) + len(finals)
        for sink, base in emit:
            sink(now, events[d - base])
        for seq in finals:
            seq.emit(now, TokenEvent(seq.stop - 1, seq.finish_reason))

    def _build_emit(self) -> list[tuple[TokenSink, int]]:
        emit = []
        for i, seq in enumerate(self._decoders.values()):
            seq.slot = i
            emit.append((seq.emit, seq.base()))
        return emit

    def _complete_prefill(self, seq: Sequence, now: float) -> None:
        if seq.generated == 0:
            self.prompt_tokens_total += seq.prompt
        index = seq.generated
        seq.generated += 1
        self.generation_tokens_total += 1
        del self._prefilling[seq.serial]
        self._rem_pre -= seq.max_tokens - index
        if seq.generated == seq.stop:
            self._used -= seq.prefill_blocks
            self._finish(seq)
            seq.emit(now, TokenEvent(index, seq.finish_reason))
            return
        self._start_decode(seq)
        seq.emit(now, self._events[index])

    def _start_decode(self, seq: Sequence) -> None:
        seq.phase = Phase.DECODE
        seq.ctx0 = seq.prefill_len
        seq.d0 = self._d
        seq.residue = (seq.d0 - seq.ctx0) % self._bs
        seq.prefill_blocks = 0  # now implied by ctx0 + d - d0
        seq.finish_step = seq.d0 + seq.stop - 1 - seq.generated
        self._finish_at.setdefault(seq.finish_step, []).append(seq)
        self._bucket[seq.residue] += 1
        self._sum_ctx += seq.ctx0
        self._rem_dec += seq.max_tokens - seq.generated + seq.d0
        self._decoders[seq.serial] = seq
        self._emit = None
        if len(self._events) < seq.stop:
            self._events.extend(TokenEvent(i, None) for i in range(len(self._events), seq.stop))

    # -- state transitions -------------------------------------------------

    def _admit(self, seq: Sequence) -> None:
        seq.phase = Phase.PREFILL
        seq.serial = self._serial
        self._serial += 1
        self._running[seq.serial] = seq
        self._prefilling[seq.serial] = seq
        self._rem_pre += seq.max_tokens - seq.generated

    def _release(self, seq: Sequence) -> None:
        """Free a running sequence's KV and take it out of every running set."""
        del self._running[seq.serial]
        if seq.phase == Phase.PREFILL:
            del self._prefilling[seq.serial]
            self._used -= seq.prefill_blocks
            self._rem_pre -= seq.max_tokens - seq.generated
            seq.prefill_blocks = 0
            return
        kv = seq.ctx0 + self._d - seq.d0
        self._used -= self._blocks(kv)
        self._sum_ctx -= kv
        self._rem_dec -= seq.max_tokens - seq.generated + seq.d0
        self._bucket[seq.residue] -= 1
        seq.generated += self._d - seq.d0  # scheduled decode steps are committed by now
        del self._decoders[seq.serial]
        if self._emit is not None and seq.slot >= 0:
            # A cancel from inside a sink while this step's tokens go out.
            self._emit[seq.slot] = (_noop, self._d)
        self._emit = None

    def _retire(self, seq: Sequence) -> None:
        self._release(seq)
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.phase = Phase.DONE
        self._seqs.pop(seq.request_id, None)
        self._running.pop(seq.serial, None)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.preemptions_total += 1
        self._preempted = True
        seq.phase = Phase.WAITING
        seq.prefill_len = seq.prompt + seq.generated  # recompute prompt and output so far
        seq.prefill_computed = 0
        self._waiting.appendleft(seq)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self._bs)
