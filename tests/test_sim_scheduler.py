"""The continuous-batching scheduler, driven through the virtual clock."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import pytest

from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.profiles import Profile, get_profile
from backends.sim.sequence import draw_output_length
from backends.sim.virtual import VirtualEngine

VLLM = "qwen3-4b/l40s/bf16/vllm"
SGLANG = "qwen3-4b/l40s/bf16/sglang"


def small(name: str = VLLM, *, kv_tokens: int | None = None, **engine: Any) -> Profile:
    p = get_profile(name)
    traits = dataclasses.replace(p.engine, **engine)
    kv = p.kv_tokens if kv_tokens is None else kv_tokens
    return dataclasses.replace(p, engine=traits, kv_tokens=kv, max_seqs=traits.max_seqs)


class Rec:
    """Listener recording (time, event) pairs."""

    def __init__(self) -> None:
        self.events: list[tuple[float, TokenEvent]] = []

    def on_token(self, now: float, event: TokenEvent) -> None:
        self.events.append((now, event))

    @property
    def indices(self) -> list[int]:
        return [e.index for _, e in self.events]

    @property
    def ttft(self) -> float:
        return self.events[0][0]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1][1].finish_reason is not None


def req(rid: str, prompt: int = 1024, out: int = 16, **kw: object) -> GenerationRequest:
    return GenerationRequest(rid, prompt, out, ignore_eos=kw.pop("ignore_eos", True), **kw)  # type: ignore[arg-type]


def test_single_request_emits_every_token_once_and_ends_with_length() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    rec = Rec()
    engine.submit(req("a", out=20), rec)
    engine.run_until_idle()
    assert rec.indices == list(range(20))
    assert [e.finish_reason for _, e in rec.events[:-1]] == [None] * 19
    assert rec.events[-1][1].finish_reason == "length"
    times = [t for t, _ in rec.events]
    assert times == sorted(times) and len(set(times)) == 20
    cost = get_profile(VLLM).cost
    assert rec.ttft == pytest.approx(cost.step_time(1024, 0, 1024 * 1025 / 2))
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
    assert stats.prompt_tokens_total == 1024 and stats.generation_tokens_total == 20


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    engine = VirtualEngine(small(token_budget=2048))
    rec = Rec()
    engine.submit(req("a", prompt=5000, out=2), rec)
    steps = 0
    while not rec.events:
        engine.advance()
        steps += 1
    assert steps == 3  # 2048 + 2048 + 904


def test_running_cap_makes_the_third_request_wait() -> None:
    engine = VirtualEngine(small(max_seqs=2))
    recs = [Rec() for _ in range(3)]
    for i, rec in enumerate(recs):
        engine.submit(req(f"r{i}", prompt=100, out=10), rec)
    engine.advance()
    assert engine.stats().running == 2 and engine.stats().waiting == 1
    engine.run_until_idle()
    assert recs[2].ttft > recs[0].events[-1][0]  # admitted only after one finished
    assert all(r.done for r in recs)


def test_request_that_does_not_fit_waits_for_kv() -> None:
    engine = VirtualEngine(small(kv_tokens=3000))
    first, second = Rec(), Rec()
    engine.submit(req("a", prompt=2000, out=50), first)
    engine.advance()
    engine.submit(req("b", prompt=1500, out=5), second)
    engine.advance()
    assert engine.stats().waiting == 1
    engine.run_until_idle()
    assert second.ttft > first.events[-1][0]
    assert engine.stats().preemptions_total == 0


def test_decode_growth_preempts_the_newest_and_it_recomputes() -> None:
    engine = VirtualEngine(small(kv_tokens=1600))
    old, new = Rec(), Rec()
    engine.submit(req("old", prompt=600, out=400), old)
    engine.submit(req("new", prompt=600, out=400), new)
    engine.run_until_idle()
    assert engine.stats().preemptions_total >= 1
    for rec in (old, new):  # every token exactly once, in order, despite recompute
        assert rec.indices == list(range(400)) and rec.done
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(new.events)]
    assert max(gaps) > 10 * min(gaps)  # the preempted one stalled while the old one ran
    assert old.events[-1][0] < new.events[-1][0]
    assert engine.stats().kv_usage == 0.0


def test_cancel_frees_kv_at_once_and_stops_tokens() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    rec = Rec()
    engine.submit(req("a", prompt=4096, out=1000), rec)
    for _ in range(10):
        engine.advance()
    assert engine.stats().kv_usage > 0
    seen = len(rec.events)
    engine.cancel("a")
    assert engine.stats().kv_usage == 0.0 and engine.stats().running == 0
    engine.run_until_idle()
    assert len(rec.events) == seen
    engine.cancel("a")  # unknown by now: harmless


def test_cancel_from_inside_a_listener_during_a_step() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    victim = Rec()

    class Killer(Rec):
        def on_token(self, now: float, event: TokenEvent) -> None:
            super().on_token(now, event)
            if event.index == 3:
                engine.cancel("victim")

    killer = Killer()
    engine.submit(req("killer", prompt=64, out=10), killer)
    engine.submit(req("victim", prompt=64, out=10), victim)
    engine.run_until_idle()
    assert killer.done and not victim.done
    # The victim joined one step later (the killer's step had started); it
    # gets no token from the step whose delivery cancelled it.
    assert victim.indices == [0, 1]
    assert engine.stats().kv_usage == 0.0


def test_arrival_mid_step_joins_at_the_next_boundary() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    engine.submit(req("a", prompt=2048, out=5), Rec())
    end = engine.next_time()
    assert end is not None
    engine.advance_to(end / 2)
    assert engine.now == end / 2
    late = Rec()
    engine.submit(req("b", prompt=16, out=1), late)
    assert engine.next_time() == end  # the step in progress is not re-planned
    engine.run_until_idle()
    assert late.ttft > end


def test_eos_is_seeded_and_bounded() -> None:
    def draw(i: int) -> tuple[int, str]:
        return draw_output_length(req(f"x{i}", out=300, ignore_eos=False, seed=i), 7)

    lengths = [draw(i) for i in range(200)]
    assert lengths == [draw(i) for i in range(200)]
    assert {reason for _, reason in lengths} == {"stop", "length"}
    assert all(1 <= n <= 300 for n, _ in lengths)
    assert all(n == 300 for n, reason in lengths if reason == "length")
    assert len({n for n, _ in lengths}) > 50  # a real spread, not one length
    engine = VirtualEngine(get_profile(VLLM), seed=7)
    rec = Rec()
    engine.submit(req("z", out=4000, ignore_eos=False, seed=3), rec)
    engine.run_until_idle()
    n, reason = draw_output_length(req("z", out=4000, ignore_eos=False, seed=3), 7)
    assert len(rec.events) == n and rec.events[-1][1].finish_reason == reason


def test_invalid_requests_are_refused() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    with pytest.raises(ValueError, match="context length"):
        engine.submit(req("a", prompt=40000, out=2000), Rec())
    engine.submit(req("b"), Rec())
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(req("b"), Rec())


def test_sglang_pauses_decoding_while_it_prefills() -> None:
    engine = VirtualEngine(get_profile(SGLANG))
    runner, newcomer = Rec(), Rec()
    engine.submit(req("runner", prompt=64, out=40), runner)
    for _ in range(10):
        engine.advance()
    engine.submit(req("new", prompt=4096, out=2), newcomer)
    engine.run_until_idle()
    prefill_end = newcomer.ttft
    times = [t for t, _ in runner.events]
    assert prefill_end not in times  # no decode token in the prefill step
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) > 5 * min(gaps)


def test_vllm_keeps_decoding_while_it_prefills() -> None:
    engine = VirtualEngine(get_profile(VLLM))
    runner, newcomer = Rec(), Rec()
    engine.submit(req("runner", prompt=64, out=40), runner)
    for _ in range(10):
        engine.advance()
    engine.submit(req("new", prompt=1024, out=2), newcomer)
    engine.run_until_idle()
    assert newcomer.ttft in [t for t, _ in runner.events]  # mixed step


def test_same_seed_same_run() -> None:
    def run() -> list[list[float]]:
        engine = VirtualEngine(small(kv_tokens=6000), seed=5)
        recs = [Rec() for _ in range(6)]
        for i, rec in enumerate(recs):
            engine.submit(
                req(f"r{i}", prompt=500 + 100 * i, out=400, ignore_eos=False, seed=i), rec
            )
        engine.run_until_idle()
        return [[t for t, _ in r.events] for r in recs]

    assert run() == run()


def _recount_blocks(engine: VirtualEngine) -> int:
    """Blocks in use recomputed from each running sequence (slow, exact)."""
    sched = engine._scheduler
    bs = sched.config.block_size
    total = 0
    for seq in sched._running.values():
        if seq.serial in sched._decoders:
            total += -(-(seq.ctx0 + sched._d - seq.d0) // bs)
        else:
            total += seq.prefill_blocks
    return total


@pytest.mark.parametrize("name", [VLLM, SGLANG])
def test_block_accounting_survives_a_crowded_random_workload(name: str) -> None:
    rng = random.Random(1)
    engine = VirtualEngine(small(name, kv_tokens=20000), seed=1)
    recs: dict[str, Rec] = {}
    for i in range(60):
        rid = f"r{i}"
        recs[rid] = Rec()
        prompt, out = rng.randint(16, 3000), rng.randint(1, 1500)
        engine.submit(req(rid, prompt=prompt, out=out, ignore_eos=False, seed=i), recs[rid])
    sched = engine._scheduler
    steps = 0
    cancelled: set[str] = set()
    while engine.next_time() is not None:
        engine.advance()
        steps += 1
        assert 0 <= sched._used <= sched.config.kv_blocks
        if steps % 7 == 0:
            assert sched._used == _recount_blocks(engine)
        if steps % 53 == 0:
            rid = f"r{rng.randrange(60)}"
            if not recs[rid].done:
                cancelled.add(rid)
            engine.cancel(rid)
    assert engine.stats().preemptions_total > 0  # the cache was really crowded
    assert sched._used == 0 and sched._sum_ctx == 0
    for rec in recs.values():
        assert rec.indices == list(range(len(rec.events)))  # in order, no repeats
    finished = {rid for rid, rec in recs.items() if rec.done}
    assert finished == set(recs) - cancelled and len(finished) >= 30
