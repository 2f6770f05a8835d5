"""Timing and token accounting of one streamed response, event by event.

TTFT is the first event that carries output (content, reasoning or a tool-call
delta), not the role-only first chunk and not the first byte. Looking inside
an event stops at a couple of byte searches (:mod:`gateway.sse_events`); JSON is
parsed only for usage: the usage chunk's, and the finishing chunk's when it carries
some.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.sse_events import (
    DONE,
    FIRST_SEQUENCE,
    blames_the_request,
    carries_output,
    carries_reasoning,
    choice_index,
    data_of,
    finish_reason_of,
    is_error_event,
    is_usage_chunk,
    of_first_sequence,
)
from gateway.window import ItlBuckets, RollingWindow

# Batching window updates keeps their cost off the per-chunk path while the
# controller still sees a stream's tokens within a fraction of a second.
FLUSH_INTERVAL_S = 0.25

# The most tokens one gap is spread over (a value each in the per-token ITL): far above
# what engines put in an event (vLLM's and SGLang's ``--stream-interval``, a few to a few
# dozen; speculative decoding, up to ~10 a step), and at 8 bytes a value, a few KB per
# event received (an event is ~100 bytes or more).
MAX_TOKENS_PER_GAP = 256


# A token count at or past this is no engine's: 2^31 tokens would take one request days
# of generation at 10,000 tokens/s, and every context today is under 2^24. Below it,
# the counts a lying backend could send are bounded for what is built from them (the
# window's tokens, the per-token gaps, see ``MAX_TOKENS_PER_GAP``).
MAX_USAGE_TOKENS = 2**31


def _count(value: Any) -> int | None:
    """A token count as the usage gives it: a whole number in range; None otherwise."""
    if not value:
        return 0  # absent or null: none reported
    if type(value) is not int or not 0 <= value < MAX_USAGE_TOKENS:
        return None
    return value


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of the completion tokens, the reasoning's (vLLM and OpenAI:
    # ``completion_tokens_details.reasoning_tokens``; SGLang: ``reasoning_tokens``).
    reasoning_tokens: int = 0

    @classmethod
    def from_json(cls, usage: Any) -> Usage | None:
        """The backend's ``usage`` object; None for anything else (untrusted input: a count
        that is no whole number, or out of range (negative, ``MAX_USAGE_TOKENS`` or more),
        must not cost the client its answer nor the gateway its measurements)."""
        if not isinstance(usage, dict):
            return None
        prompt = _count(usage.get("prompt_tokens"))
        completion = _count(usage.get("completion_tokens"))
        if prompt is None or completion is None:
            return None
        details = usage.get("completion_tokens_details")
        reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
        if reasoning is None:
            reasoning = usage.get("reasoning_tokens")
        if type(reasoning) is not int or not 0 < reasoning <= completion:
            reasoning = 0  # unreadable: no correction rather than a wrong one
        return cls(prompt, completion, reasoning)


@dataclass(slots=True)
class StreamMeter:
    """Feeds on framed events in arrival order; reads times from ``clock``.

    Each stream's first output events take a slow path (:meth:`_early_output`) that
    tells its sequences apart and looks at how reasoning is streamed; from the second
    event of the first sequence on, a stream of one sequence costs one comparison
    an event.
    """

    started: float  # when the gateway received the request
    strip_usage: bool = False  # the gateway asked for usage; the client did not
    clock: Callable[[], float] = time.perf_counter
    first_output: float | None = None
    last_output: float | None = None
    output_events: int = 0
    gaps: list[float] = field(default_factory=list)
    usage: Usage | None = None
    finish_reason: str | None = None
    # The first sequence's finishing event carried no output: vLLM's empty last chunk,
    # whose token (the EOS) usage counts though no output event carried it.
    finish_empty: bool = False
    # False: the answer is no event stream (NDJSON, text), relayed unmetered: no first
    # token can be seen in it, so its end bounds none.
    metered: bool = True
    upstream_error: bool = False
    client_error: bool = False  # the engine's error event blames the request (a 4xx code)
    done: bool = False
    # The request may stream several sequences (n > 1, a list of prompts): each output
    # event's gap then runs from its own sequence's last output time. Also set once an
    # event of a sequence other than the first shows up (``n`` the request spelled in a
    # way the gateway did not read as > 1).
    several_sequences: bool = False
    last_by_sequence: dict[int | None, float] | None = None
    # Live feed of the backend's rolling window (None: not fed, e.g. in the bench).
    window: RollingWindow | None = None
    admitted: float = 0.0  # when the backend was chosen; its TTFT starts here
    flushed_gaps: int = 0
    flushed_events: int = 0
    last_flush: float = 0.0
    # One sequence, past its first gap: the per-event fast path.
    plain: bool = False
    # Reasoning, for tokens that were never streamed (see _carried): the output events
    # that opened a sequence with reasoning, and whether the first second output event
    # of a sequence carried reasoning (None: not seen yet).
    reasoning_openings: int = 0
    reasoning_streamed: bool | None = None
    # Live ITL feeds made with an estimated tokens-per-event ratio, to correct at the
    # end: (the window's buckets they went to, first gap, end gap, tokens, events).
    estimated: list[tuple[ItlBuckets, int, int, int, int]] = field(default_factory=list)
    # Output tokens fed to the window, flush by flush: (the window's entry, first gap, end
    # gap, output events), so that the usage's exact counts replace them at the end.
    fed: list[tuple[list[float], int, int, int]] = field(default_factory=list)

    def observe(self, events: list[bytes]) -> list[bytes] | None:
        """Record ``events``; returns the events to forward when some must be dropped."""
        now = self.clock()
        dropped: list[int] | None = None
        for position, event in enumerate(events):
            if self.finish_reason is None:
                reason = finish_reason_of(event)
                if reason is not None:
                    # The first sequence's, as a whole answer's is read (its first choice).
                    if of_first_sequence(event):
                        self.finish_reason = reason
                        self.finish_empty = not carries_output(event)
                        if b'"usage"' in event:
                            # Usage riding on the last chunk with choices, not on one of
                            # its own (continuous usage stats put it on every chunk).
                            self._read_usage(event)
                    elif not self.several_sequences:
                        self._split_sequences()
            if carries_output(event):
                if self.plain:
                    self.gaps.append(now - self.last_output)  # type: ignore[operator]
                else:
                    self._early_output(event, now)
                self.last_output = now
                self.output_events += 1
            # The usage-only chunk has empty choices: it never carries output.
            elif is_usage_chunk(event):
                self._read_usage(event)
                if self.strip_usage:
                    dropped = [position] if dropped is None else [*dropped, position]
            elif event.startswith(DONE):
                self.done = True
            elif is_error_event(event):
                if blames_the_request(event):
                    self.client_error = True
                else:
                    self.upstream_error = True
        if self.window is not None and now - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush(now)
        if dropped is None:
            return None
        return [event for position, event in enumerate(events) if position not in dropped]

    def _early_output(self, event: bytes, now: float) -> None:
        """An output event off the fast path: of a stream of several sequences, or before
        the first sequence's second output event. Its gap runs from the same sequence's
        previous output event, not from another sequence's."""
        if self.first_output is None:
            self.first_output = self.last_flush = now
            if self.window is not None:
                self.window.add_ttft(now, now - self.admitted)
        seen = self.last_by_sequence
        if seen is None:
            seen = self.last_by_sequence = {}
        index = 0 if FIRST_SEQUENCE in event else choice_index(event)
        if index is None and not self.several_sequences:
            index = 0  # an event whose index cannot be read is the one sequence's
        last = seen.get(index)
        seen[index] = now
        if last is None:
            if carries_reasoning(event):
                self.reasoning_openings += 1
            if index not in (0, None) and not self.several_sequences:
                self._split_sequences()
            return
        self.gaps.append(now - last)
        if self.reasoning_streamed is None:
            self.reasoning_streamed = carries_reasoning(event)
        if not self.several_sequences:
            # The first sequence's second event, and no other sequence: one sequence.
            self.plain = True
            self.last_by_sequence = None

    def _split_sequences(self) -> None:
        """An event of another sequence than the first: time each one on its own from
        now on (the output events so far were the first sequence's)."""
        self.several_sequences = True
        self.plain = False
        if self.last_by_sequence is None and self.last_output is not None:
            self.last_by_sequence = {0: self.last_output}

    def flush(self, now: float, *, final: bool = False) -> None:
        """Hand the gaps and output events seen since the last flush to the window.

        The window counts ITL per token, as ``token_gaps`` does, but how many tokens an
        event carries (vLLM's ``--stream-interval``, speculative decoding) is known only
        from the usage at the end. While the stream runs, each gap is spread over the
        backend's recent tokens per event (learned from its finished streams; one
        before the first) and remembered; the final flush spreads the rest by the
        stream's own usage and replaces what was estimated by the same values, in the
        one-second slices they went to, so that once a stream ends the window holds
        exactly its ``token_gaps()``. Its output tokens likewise: counted live at the
        same ratio, set at the end to what each flush's events carried by the usage, up
        or down, and to the usage's total. Costs nothing per chunk: a flush runs every
        ``FLUSH_INTERVAL_S`` and at the end.
        """
        window = self.window
        if window is None:
            return
        start, end = self.flushed_gaps, len(self.gaps)
        carried = self._carried() if final else None
        if carried is None:
            tokens, events = window.tokens_per_event
        else:
            tokens, events = carried
            for buckets, first, last, was_tokens, was_events in self.estimated:
                if not _same_spread(was_tokens, was_events, tokens, events):
                    part = self.gaps[first:last]
                    buckets.remove_many(_spread(part, first, was_tokens, was_events))
                    buckets.add_many(_spread(part, first, tokens, events))
            self.estimated.clear()
        if end > start:
            buckets = window.add_itl(now, _spread(self.gaps[start:end], start, tokens, events))
            if carried is None:
                self.estimated.append((buckets, start, end, tokens, events))
        output = self.output_events - self.flushed_events
        entry = window.add_tokens(now, _tokens_of(output, start, end, tokens, events))
        if entry is not None:
            self.fed.append((entry, start, end, output))
        self.flushed_gaps = end
        self.flushed_events = self.output_events
        self.last_flush = now
        if final and self.usage is not None:
            self._settle_tokens(now, window, self.usage, tokens, events)

    def _settle_tokens(
        self, now: float, window: RollingWindow, usage: Usage, tokens: int, events: int
    ) -> None:
        """The usage is exact: each flush's output tokens become what its events carried
        (``tokens`` in every ``events`` gaps, as the ITL was spread), and the stream's total
        the usage's (tokens no output event carried, the EOS of an empty last chunk or
        reasoning never streamed, go in at the end)."""
        left = usage.completion_tokens
        for entry, first, last, output in self.fed:
            entry[1] = exact = _tokens_of(output, first, last, tokens, events)
            left -= exact
        if left > 0:
            window.add_tokens(now, left)
        else:  # fewer than the events read (a usage that undercounts): the latest go first
            for entry, *_ in reversed(self.fed):
                if not left:
                    break
                taken = min(int(entry[1]), -left)
                entry[1] -= taken
                left += taken
        self.fed.clear()

    def _read_usage(self, event: bytes) -> None:
        """Keeps the usage read before when this one cannot be read."""
        try:
            usage = Usage.from_json(json.loads(data_of(event)).get("usage"))
        except (ValueError, AttributeError):
            usage = None
        if usage is not None:
            self.usage = usage

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    def _carried(self) -> tuple[int, int] | None:
        """The tokens the gaps carried, and the gaps (from the usage; None without it):
        what spreads each gap over its tokens.

        An event with no gap before it (each sequence's first) is taken to carry one
        token: vLLM sends the first token alone, whatever its ``--stream-interval``, and
        k tokens an event after it. Spreading the usage over every event instead read a
        first event of one token and events of four as 3.3 tokens a gap.

        Tokens no output event carried are no gap's: the EOS of vLLM's empty last chunk
        (a one-token answer read as two tokens an event, which the window then learned),
        and tokens generated before the first output event, which are the TTFT's:
        reasoning an engine did not stream (vLLM's ``include_reasoning: false`` drops
        its deltas) or sent in one block as the first event (SGLang's
        ``stream_reasoning: false``) is counted in ``completion_tokens`` all the same.
        So when the first second output event of a sequence carries no reasoning, the
        usage's reasoning tokens are taken out, and so are the events that opened a
        sequence with reasoning (each such block is the TTFT's event)."""
        usage = self.usage
        if usage is None:
            return None
        tokens, events = usage.completion_tokens, self.output_events
        if usage.reasoning_tokens and not self.reasoning_streamed:
            tokens -= usage.reasoning_tokens
            events -= self.reasoning_openings
        if self.finish_empty and self.finish_reason == "stop" and not self.several_sequences:
            tokens -= 1
        gaps = len(self.gaps)
        if not gaps:
            return None
        openings = events - gaps  # events with no gap before them: a token each
        # A usage claiming more is no engine's: the per-token gaps stay a bounded multiple
        # of the events received, whatever count a backend sends.
        return min(tokens - openings, gaps * MAX_TOKENS_PER_GAP), gaps

    @property
    def tokens_per_event(self) -> float | None:
        """The output tokens a gap carried, from the usage (at least one); None without it
        or without a gap."""
        carried = self._carried()
        return None if carried is None else max(1.0, carried[0] / carried[1])

    def token_gaps(self) -> list[float]:
        """Inter-token latencies: the gap before an event carrying k tokens, as k values of
        gap/k, so they add up to the time from the first output event to the last (of
        each sequence, when the stream holds several).

        The events after each sequence's first are taken to carry the usage's tokens
        evenly (see ``_carried`` for what is left out); k is a whole number per event,
        spread so that the gaps hold exactly the tokens they carried."""
        carried = self._carried()
        if carried is None:
            return self.gaps
        return _spread(self.gaps, 0, *carried)


def _spread(gaps: list[float], first: int, tokens: int, events: int) -> list[float]:
    """``gaps`` (the stream's from index ``first`` on) as per-token values, ``tokens`` in
    every ``events`` gaps: gap i stands for ``(i+1)*tokens//events - i*tokens//events``
    tokens, so that spreading a stream's gaps in parts gives the values of spreading them
    whole. At most a token a gap: the gaps as they are."""
    if tokens <= events:
        return gaps
    spread: list[float] = []
    before = first * tokens // events
    for index, gap in enumerate(gaps, first + 1):
        upto = index * tokens // events
        if upto > before:
            spread += [gap / (upto - before)] * (upto - before)
        before = upto
    return spread


def _tokens_of(output: int, first: int, end: int, tokens: int, events: int) -> int:
    """The output tokens of ``output`` events holding gaps ``first`` to ``end``, ``tokens``
    in every ``events`` gaps as :func:`_spread` spreads them: a token each event with no
    gap before it."""
    gaps = end - first
    if tokens <= events:
        return output
    return output - gaps + end * tokens // events - first * tokens // events


def _same_spread(tokens: int, events: int, other_tokens: int, other_events: int) -> bool:
    """Whether two ratios spread gaps into the same values (equal fractions, or both at
    most a token an event)."""
    if tokens <= events and other_tokens <= other_events:
        return True
    return tokens * other_events == other_tokens * events
