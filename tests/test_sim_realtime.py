"""The real-clock engine behind the simulated backend's HTTP face."""

from __future__ import annotations

import time

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.scrape import parse_kv_capacity
from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.factory import make_engine
from backends.sim.profiles import get_profile
from backends.sim.realtime import RealtimeEngine, TokenStream, build_engine
from backends.sim.virtual import VirtualEngine

pytestmark = pytest.mark.anyio
VLLM = "qwen3-4b/l40s/bf16/vllm"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make(speed: float, profile: str = VLLM) -> RealtimeEngine:
    return RealtimeEngine(get_profile(profile), speed=speed)


def req(rid: str, prompt: int = 1024, out: int = 20) -> GenerationRequest:
    return GenerationRequest(rid, prompt, out, ignore_eos=True)


def virtual_ttft_and_e2e(prompt: int, out: int) -> tuple[float, float]:
    engine = VirtualEngine(get_profile(VLLM))
    times: list[float] = []

    class L:
        def on_token(self, now: float, event: TokenEvent) -> None:
            times.append(now)

    engine.submit(req("v", prompt, out), L())
    engine.run_until_idle()
    return times[0], times[-1]


async def test_tokens_arrive_at_engine_speed() -> None:
    engine = make(20.0)
    await engine.start()
    try:
        start = time.monotonic()
        stamps: list[float] = []
        events = []
        async for event in engine.generate(req("a", out=40)):
            stamps.append(time.monotonic() - start)
            events.append(event)
    finally:
        await engine.aclose()
    assert [e.index for e in events] == list(range(40))
    assert events[-1].finish_reason == "length"
    ttft, e2e = virtual_ttft_and_e2e(1024, 40)
    assert stamps[0] >= 0.9 * ttft / 20  # not sooner than the modelled GPU allows
    assert stamps[-1] >= 0.9 * e2e / 20
    assert stamps[-1] < e2e / 20 + 1.0  # and not stuck either


async def test_closing_the_stream_early_cancels_and_frees_kv() -> None:
    engine = make(50.0)
    await engine.start()
    try:
        stream = engine.generate(req("a", prompt=4096, out=5000))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        assert engine.stats().kv_usage > 0
        await stream.aclose()
        stats = engine.stats()
        assert stats.running == 0 and stats.kv_usage == 0.0
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    finally:
        await engine.aclose()


async def test_invalid_request_fails_at_submit() -> None:
    engine = make(50.0)
    with pytest.raises(ValueError, match="context length"):
        engine.generate(req("a", prompt=40000, out=4000))
    with pytest.raises(KeyError, match="valid profiles"):
        build_engine("nope/none/bf16/vllm")
    named = build_engine(VLLM, model="my-model")
    assert b'model_name="my-model"' in named.render_metrics()


async def test_concurrent_requests_share_steps_and_all_finish() -> None:
    engine = make(100.0)
    await engine.start()
    counts: dict[str, int] = {}

    async def client(i: int) -> None:
        n = 0
        async for _ in engine.generate(req(f"r{i}", prompt=256, out=30 + i)):
            n += 1
        counts[f"r{i}"] = n

    try:
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(client, i)
    finally:
        await engine.aclose()
    assert counts == {f"r{i}": 30 + i for i in range(16)}
    assert engine.stats().generation_tokens_total == sum(counts.values())


async def metrics_after_one_request(engine: RealtimeEngine) -> str:
    """The engine's /metrics text once it has served one 10-token request."""
    await engine.start()
    try:
        async for _ in engine.generate(req("a", out=10)):
            pass
    finally:
        await engine.aclose()
    return engine.render_metrics().decode()


async def test_metrics_use_vllm_names_and_engine_seconds() -> None:
    engine = make(20.0)
    text = await metrics_after_one_request(engine)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "kneecap_sim_cancelled_requests",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert name in families, name
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["vllm:generation_tokens_total"].value == 10
    assert samples["vllm:prompt_tokens_total"].value == 1024
    assert samples["vllm:num_preemptions_total"].value == 0
    assert samples["vllm:generation_tokens_total"].labels == {"model_name": "Qwen/Qwen3-4B"}
    assert samples["vllm:inter_token_latency_seconds_count"].value == 9
    ttft = samples["vllm:time_to_first_token_seconds_sum"].value
    expected, _ = virtual_ttft_and_e2e(1024, 10)
    # Engine seconds, not wall seconds divided by the speed-up.
    assert expected * 0.9 <= ttft <= expected * 1.5


async def test_sglang_metric_names() -> None:
    engine = RealtimeEngine(get_profile("qwen3-4b/l40s/awq/sglang"), speed=50.0)
    text = await metrics_after_one_request(engine)
    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    samples = {s.name: s.value for f in families for s in f.samples}
    assert samples["sglang:prompt_tokens_total"] == 1024
    assert samples["sglang:generation_tokens_total"] == 10
    assert names == {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:time_to_first_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:e2e_request_latency_seconds",
        "sglang:max_total_num_tokens",
        "kneecap_sim_cancelled_requests",
    }
    assert 'model_name="Qwen/Qwen3-4B-AWQ"' in text


@pytest.mark.parametrize("profile", [VLLM, "qwen3-4b/l40s/awq/sglang"])
async def test_the_kv_cache_size_is_stated_as_the_engine_states_it(profile: str) -> None:
    # A gateway in front of an external simulator read no capacity from its /metrics
    # (vLLM's cache_config_info, SGLang's max_total_num_tokens), so its token budget was off.
    engine = RealtimeEngine(get_profile(profile), speed=50.0)
    text = engine.render_metrics().decode()
    assert parse_kv_capacity(text) == get_profile(profile).kv_tokens


async def test_hundreds_of_sequences_at_real_speed_do_not_hog_a_cpu() -> None:
    engine = make(1.0)
    await engine.start()
    streams = [engine.generate(req(f"r{i}", prompt=16, out=10_000)) for i in range(200)]

    async def drain(stream: TokenStream) -> None:
        async for _ in stream:
            pass

    try:
        cpu0, wall0 = time.process_time(), time.monotonic()
        with anyio.move_on_after(1.5):
            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(drain, s)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        assert engine.stats().running == 200
        assert engine.stats().generation_tokens_total > 200 * 5  # it did run
    finally:
        for s in streams:
            await s.aclose()
        await engine.aclose()
    assert engine.stats().kv_usage == 0.0
    assert cpu < 0.5 * wall


async def test_a_fixed_latency_engine_reports_engine_seconds_at_any_speed() -> None:
    # At --speed 10 its histograms read wall seconds: a tenth of the configured TTFT.
    engine = make_engine(model="m", ttft_ms=100, itl_ms=20, speed=10)
    request = GenerationRequest(request_id="r", prompt_tokens=4, max_tokens=3, seed=1)
    async for _ in engine.generate(request):
        pass
    families = text_string_to_metric_families(engine.render_metrics().decode())
    ttft = next(f for f in families if f.name == "vllm:time_to_first_token_seconds")
    (total,) = [s.value for s in ttft.samples if s.name.endswith("_sum")]
    assert total >= 0.099  # 100 ms of engine time, whatever the wall clock added
