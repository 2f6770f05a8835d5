"""Counting prompt tokens, and admission in tokens (claims on top of admission's leases)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from backends.replica import Replica
from backends.scrape import parse_kv_capacity
from backends.sim.tokenizer import count_chat_tokens, count_text_tokens
from gateway.routing import RoutingState, token_limit_of
from gateway.settings import BackendConfig, ConfigError, RoutingConfig, build_settings
from gateway.tokens import MOST_CHARS_PER_TOKEN, CharsPerToken, ChatTemplate, TokenizerFiles
from policies.admission import Outcome, PoolAdmission, Priority
from policies.long_context import exceeds_every_context
from policies.prompt_size import PromptShape, output_tokens, shape_of
from policies.routing import Load
from policies.token_budget import Claim, token_budget

FAR = 1e9
MODEL = "m"


@dataclass(eq=False)
class Backend:
    name: str
    limit: int
    token_limit: int
    in_flight: int = 0
    tokens_in_flight: int = 0

    def load(self) -> Load:
        return Load(self.name, self.in_flight, self.limit, self.tokens_in_flight, self.token_limit)


def picker(backend: Backend, cost: int):
    def pick() -> Claim[Backend] | None:
        return Claim(backend, cost) if backend.load().fits(cost) else None

    return pick


async def admit(admission: PoolAdmission, pick):
    return await admission.acquire(pick, priority=Priority.INTERACTIVE, deadline=FAR)


# --- prompt shape -----------------------------------------------------------------


def test_chat_shape_counts_every_message_tools_and_parts() -> None:
    payload = {
        "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    shape = shape_of(payload)
    assert shape.messages == 2 and shape.chat
    assert shape.texts[:2] == ("abcd", "efgh")
    assert shape.chars == 8 + len(shape.texts[2])


def test_completion_shapes() -> None:
    assert shape_of({"prompt": "abcdefgh"}) == PromptShape(("abcdefgh",), 0, 0)
    assert shape_of({"prompt": [1, 2, 3]}) == PromptShape((), 0, 3)
    assert shape_of({"prompt": ["ab", "cd"]}).chars == 4
    assert shape_of({"input": "xyz"}).chars == 3


def test_output_tokens_is_part_of_the_cost() -> None:
    assert output_tokens({"max_tokens": 100}, 256) == 100
    assert output_tokens({"max_completion_tokens": 50, "max_tokens": 100}, 256) == 50
    assert output_tokens({}, 256) == 256
    assert output_tokens({"max_tokens": True}, 256) == 256


# --- chars per token, calibrated ------------------------------------------------------


def chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def test_calibration_converges_to_the_backends_usage() -> None:
    """CJK text is 3 UTF-8 bytes per char: the simulator counts 4 bytes a token."""
    estimator = CharsPerToken(prior=4.0, alpha=0.1, template=ChatTemplate(4, 3))
    prompts = [chat("日本語のテキスト" * n) for n in (300, 500, 800, 1200, 2000)]
    truth = count_chat_tokens(prompts[-1]["messages"])
    first = estimator.estimate(MODEL, shape_of(prompts[-1]))
    assert first < truth / 2  # the prior is far off: 4 chars a token, not 1.33
    for payload in prompts[:-1]:
        assert estimator.observe(MODEL, shape_of(payload), count_chat_tokens(payload["messages"]))
    assert estimator.chars_per_token(MODEL) == pytest.approx(4 / 3, rel=0.01)
    assert estimator.estimate(MODEL, shape_of(prompts[-1])) == pytest.approx(truth, rel=0.01)
    assert estimator.chars_per_token("other") == 4.0  # per model
    assert estimator.observations(MODEL) == 4


def test_calibration_keeps_following_slowly_after_warm_up() -> None:
    estimator = CharsPerToken(prior=4.0, alpha=0.1)
    text = chat("abcd" * 500)  # 4 chars per token
    for _ in range(30):
        estimator.observe(MODEL, shape_of(text), 500 + 7)
    estimator.observe(MODEL, shape_of(text), 1000 + 7)  # one odd report: 2 chars per token
    assert 3.5 < estimator.chars_per_token(MODEL) < 4.0


def test_tiny_prompts_do_not_calibrate() -> None:
    estimator = CharsPerToken()
    assert not estimator.observe(MODEL, shape_of(chat("hi")), 9)
    assert estimator.chars_per_token(MODEL) == 4.0


def test_estimate_counts_template_overhead_and_token_ids() -> None:
    estimator = CharsPerToken(prior=4.0, template=ChatTemplate(4, 3))
    payload = {
        "messages": [{"role": "system", "content": "a" * 400}, chat("b" * 400)["messages"][0]]
    }
    assert estimator.estimate(MODEL, shape_of(payload)) == count_chat_tokens(payload["messages"])
    assert estimator.estimate(MODEL, shape_of({"prompt": [5] * 77})) == 77
    assert estimator.estimate(MODEL, shape_of({"prompt": "x" * 4000})) == count_text_tokens(
        "x" * 4000
    )


# --- exact: a local tokenizer.json --------------------------------------------------


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_tokenizer_file_counts_exactly(tokenizer_file: Path) -> None:
    files = TokenizerFiles(ChatTemplate(4, 3))
    payload = {
        "messages": [
            {"role": "system", "content": "hello world"},
            {"role": "user", "content": "foo bar baz hello"},
        ]
    }
    assert files.count(str(tokenizer_file), shape_of(payload)).tokens == 2 + 4 + 2 * 4 + 3
    assert files.count(str(tokenizer_file), shape_of({"prompt": "hello " * 1000})).tokens == 1000


def test_tool_definitions_counted_by_a_tokenizer_route_but_do_not_refuse(
    tokenizer_file: Path,
) -> None:
    """A template may render no tool at all (`tool_choice: "none"` with some): 12 tokens of
    messages and thousands of tokens of tool JSON were refused as surely over a context."""
    tool = {"type": "function", "function": {"name": "hello", "description": "foo " * 500}}
    payload = {
        "messages": [{"role": "user", "content": "hello world"}],
        "tools": [tool] * 4,
        "tool_choice": "none",
    }
    shape = shape_of(payload)
    counted = TokenizerFiles(ChatTemplate(4, 3)).count(str(tokenizer_file), shape)
    assert counted.tokens > 2000 and not counted.exact  # routes as if the tools were rendered
    assert counted.fewest == 2  # refuses only by what every template renders
    assert not exceeds_every_context([1024], counted.longest_fewest(shape), 0)


def test_a_tokenized_batch_judges_its_longest_text_by_its_own_count(tmp_path: Path) -> None:
    """The exact total was split by character share: 16 spaces a token next to one
    character a token made the longest of two inputs that fit (1,000 and 1,900 tokens)
    count 2,593 on a 2,048 context, refused."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, " " * 16: 1, "字": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(pattern=" " * 16, behavior="isolated"),
            tokenizers.pre_tokenizers.Split(pattern="字", behavior="isolated"),
        ]
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    shape = shape_of({"input": [" " * 16 * 1000, "字" * 1900]})
    counted = TokenizerFiles().count(str(path), shape)
    assert (counted.tokens, counted.exact) == (2900, True)
    assert counted.longest_fewest(shape) == counted.longest_likely(shape) == 1900
    assert not exceeds_every_context([2048], counted.longest_fewest(shape), 0)
    # One text is not a batch: its count is the whole.
    alone = TokenizerFiles().count(str(path), shape_of({"prompt": "字" * 30}))
    assert alone.longest is None and alone.longest_fewest(shape_of({"prompt": "字" * 30})) == 30


def test_routing_state_uses_the_tokenizer_only_in_tokenizer_mode(tokenizer_file: Path) -> None:
    state = RoutingState()
    payload = {"prompt": "hello " * 1000}  # 6000 chars, 1000 tokens
    tokenizer = RoutingConfig(
        estimator={"mode": "tokenizer", "tokenizers": {MODEL: str(tokenizer_file)}}
    )
    state.configure(tokenizer)
    exact = state.estimate_locally(MODEL, shape_of(payload), tokenizer)
    assert (exact.tokens, exact.exact) == (1000, True)
    other = state.estimate_locally("another", shape_of(payload), tokenizer)
    assert (other.tokens, other.exact) == (1500, False)  # no tokenizer: chars / 4
    chars = RoutingConfig(estimator={"tokenizers": {MODEL: str(tokenizer_file)}})
    state.configure(chars)
    assert not state.estimate_locally(MODEL, shape_of(payload), chars).exact


def test_a_missing_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"routing\.estimator.*no such file"):
        build_settings(
            {"routing": {"estimator": {"tokenizers": {MODEL: str(tmp_path / "nope.json")}}}}
        )


# --- admission in tokens ------------------------------------------------------------


def test_token_budget_sources() -> None:
    assert token_budget(configured=5, kv_capacity=100, kv_fraction=0.9, default=7) == 5
    assert token_budget(configured=None, kv_capacity=100, kv_fraction=0.9, default=7) == 90
    assert token_budget(configured=None, kv_capacity=None, kv_fraction=0.9, default=7) == 7
    assert token_budget(configured=None, kv_capacity=None, kv_fraction=0.9, default=None) is None


def test_a_claim_moves_a_permit_and_its_tokens_together() -> None:
    backend = Backend("b", limit=4, token_limit=1000)
    claim = Claim(backend, 300)
    claim.in_flight += 1
    assert (backend.in_flight, backend.tokens_in_flight) == (1, 300)
    with pytest.raises(RuntimeError):
        claim.in_flight += 1
    claim.in_flight -= 1
    assert (backend.in_flight, backend.tokens_in_flight) == (0, 0)
    with pytest.raises(RuntimeError):
        claim.in_flight -= 1


@pytest.mark.anyio
async def test_a_long_request_waits_for_tokens_while_request_slots_are_free() -> None:
    backend = Backend("b", limit=8, token_limit=10_000)
    admission: PoolAdmission[Claim[Backend]] = PoolAdmission(max_queue_depth=8, batch_share=0.1)
    first = await admission.acquire(
        picker(backend, 8_000), priority=Priority.INTERACTIVE, deadline=FAR
    )
    got: list = []

    async def second() -> None:
        got.append(await admit(admission, picker(backend, 4_000)))

    async with anyio.create_task_group() as group:
        group.start_soon(second)
        await wait_all_tasks_blocked()
        assert admission.depth() == 1 and backend.in_flight == 1  # 7 request slots free
        first.release(Outcome.SUCCESS)
    assert (backend.in_flight, backend.tokens_in_flight) == (1, 4_000)
    got[0].release(Outcome.SUCCESS)
    got[0].release(Outcome.DROPPED)  # a second release is a no-op
    assert (backend.in_flight, backend.tokens_in_flight, admission.leased) == (0, 0, 0)


@pytest.mark.anyio
async def test_a_granted_waiter_that_dies_gives_its_tokens_back() -> None:
    backend = Backend("b", limit=8, token_limit=10_000)
    admission: PoolAdmission[Claim[Backend]] = PoolAdmission(max_queue_depth=8, batch_share=0.1)
    first = await admit(admission, picker(backend, 8_000))
    got: list = []
    scopes: list[anyio.CancelScope] = []

    async def second() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            got.append(await admit(admission, picker(backend, 4_000)))

    async with anyio.create_task_group() as group:
        group.start_soon(second)
        await wait_all_tasks_blocked()
        # The grant races the cancellation: the claim goes to a task already cancelled.
        scopes[0].cancel()
        first.release(Outcome.SUCCESS)
    assert got == []
    assert (backend.in_flight, backend.tokens_in_flight, admission.leased) == (0, 0, 0)


# --- where a token budget comes from ------------------------------------------------

VLLM_METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'num_cpu_blocks="None",num_gpu_blocks="16384"} 1.0\n'
)
SGLANG_METRICS = (
    "# TYPE sglang:max_total_num_tokens gauge\n"
    'sglang:max_total_num_tokens{tp_rank="0"} 161721.0\n'
    'sglang:max_total_num_tokens{tp_rank="1"} 161721.0\n'
)


def test_kv_capacity_is_read_from_the_engines_metrics() -> None:
    assert parse_kv_capacity(VLLM_METRICS) == 16384 * 128
    assert parse_kv_capacity(SGLANG_METRICS) == 161721  # tensor-parallel ranks share one pool
    assert parse_kv_capacity("# TYPE vllm:num_requests_running gauge\n") is None


@pytest.mark.parametrize("blocks", ["\u00b2", "\uff11\uff12", "9" * 5000, "None"])
def test_a_block_count_no_integer_reads_is_no_capacity(blocks: str) -> None:
    metrics = VLLM_METRICS.replace('num_gpu_blocks="16384"', f'num_gpu_blocks="{blocks}"')
    assert parse_kv_capacity(metrics) is None


def replica(**config: object) -> Replica:
    return Replica(BackendConfig(name="r", url="http://127.0.0.1:1", **config), "http://x")  # type: ignore[arg-type]


def test_token_limit_sources_in_order() -> None:
    routing = RoutingConfig()
    assert token_limit_of(replica(), routing) is None  # nothing known: requests only
    reported = replica()
    reported.kv_capacity_tokens = 100_000
    assert token_limit_of(reported, routing) == 95_000
    assert token_limit_of(replica(max_tokens_in_flight=5_000), routing) == 5_000
    profile = Replica(
        BackendConfig(name="p", sim={"profile": "qwen3-4b/l40s/bf16/vllm"}), "http://x"
    )
    assert token_limit_of(profile, routing) == int(218_096 * 0.95)  # six 32K+256 requests
    default = RoutingConfig(token_budget={"default_max_tokens_in_flight": 7_000})
    assert token_limit_of(replica(), default) == 7_000
    off = RoutingConfig(token_budget={"enabled": False})
    assert token_limit_of(replica(max_tokens_in_flight=5_000), off) is None


# --- what fits a context: a floor no tokenizer goes under, shapes that say what they hold ---

CJK = chat("日本語のテキスト" * 1000)  # 8,000 characters, 24,000 bytes: 6,007 tokens
ENGLISH = chat("word " * 4000)  # 20,000 characters: 5,007 tokens


def test_the_floor_stays_under_the_true_count_after_a_dense_script_calibrated_the_ratio() -> None:
    """One CJK prompt calibrates the model to 1.33 characters a token; an English prompt
    then estimates three times its tokens, but its floor (what a context must hold at
    least) is its characters at the most a token covers: under its true count."""
    estimator = CharsPerToken(prior=4.0, template=ChatTemplate(4, 3))
    assert estimator.observe(MODEL, shape_of(CJK), count_chat_tokens(CJK["messages"]))
    assert estimator.chars_per_token(MODEL) == pytest.approx(4 / 3, rel=0.01)
    shape = shape_of(ENGLISH)
    floor = estimator.estimate_with_floor(MODEL, shape).floor
    assert floor == 20_000 // MOST_CHARS_PER_TOKEN < count_chat_tokens(ENGLISH["messages"])
    assert estimator.estimate(MODEL, shape) == pytest.approx(20_000 * 3 / 4 + 7, rel=0.01)


def test_the_floor_does_not_follow_a_calibrated_ratio_sparser_than_the_prior() -> None:
    """Eight characters a token calibrated: the estimate follows, the floor does not (a
    ratio is an average over a model's traffic, not a bound)."""
    estimator = CharsPerToken(prior=4.0, template=ChatTemplate(4, 3))
    sparse = chat("x" * 8000)
    assert estimator.observe(MODEL, shape_of(sparse), 1000 + 7)  # 8 characters a token
    shape = shape_of(ENGLISH)
    estimate = estimator.estimate_with_floor(MODEL, shape)
    assert (estimate.tokens, estimate.floor) == (2500 + 7, 20_000 // MOST_CHARS_PER_TOKEN)


def test_a_prompt_with_an_image_does_not_calibrate() -> None:
    """Its usage counts the image's tokens, which its characters do not show: as text,
    they would drag the ratio down for every later prompt."""
    parts = [{"type": "text", "text": "word " * 400}, {"type": "image_url", "image_url": {}}]
    shape = shape_of({"messages": [{"role": "user", "content": parts}]})
    assert shape.media
    estimator = CharsPerToken(prior=4.0)
    assert not estimator.observe(MODEL, shape, 1200)
    assert estimator.chars_per_token(MODEL) == 4.0
    assert estimator.observations(MODEL) == 0


def test_shapes_give_the_longest_sequences_share_of_a_batch() -> None:
    assert shape_of({"input": ["ab", "abcdef"]}).longest_of(100) == 75
    ids = shape_of({"prompt": [[1, 2, 3], [4]]})
    assert (ids.token_ids, ids.longest_of(4)) == (4, 3)
    assert shape_of({"prompt": "abcdef"}).longest_of(100) == 100
    assert shape_of({"prompt": [1, 2, 3]}).longest_of(100) == 100  # one prompt of ids
    assert shape_of(chat("abcdef")).longest_of(100) == 100


def test_only_content_parts_other_than_text_are_media() -> None:
    text_parts = [{"type": "text", "text": "abcd"}]
    assert not shape_of({"messages": [{"role": "user", "content": text_parts}]}).media
    assert not shape_of(chat("abcd")).media
    image = [*text_parts, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert shape_of({"messages": [{"role": "user", "content": image}]}).media
