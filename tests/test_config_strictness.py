"""Config mistakes that used to load and run quietly wrong are refused, naming the key.

Each case was reproduced before its fix: an unmounted secret opened the gateway to
everyone, a repeated YAML key dropped a block, two backends at one engine admitted
twice its knee, an empty ``--config`` started the simulated default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config_warnings import config_warnings, shadowed_pools, shared_engines
from gateway.settings import ConfigError, build_settings, load_settings
from tests.procs import backend, start_gateway, start_sim
from tests.test_cli import run_cli

NOWHERE = "http://127.0.0.1:9"


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        build_settings(data)
    return str(caught.value)


def test_client_keys_from_an_unset_or_empty_variable_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = {"auth": {"api_keys_env": "KNEECAP_TEST_KEYS"}}
    monkeypatch.delenv("KNEECAP_TEST_KEYS", raising=False)
    assert "KNEECAP_TEST_KEYS" in refusal(config)
    monkeypatch.setenv("KNEECAP_TEST_KEYS", " , ")
    assert "holds no key" in refusal(config)
    monkeypatch.setenv("KNEECAP_TEST_KEYS", "k1,k2")
    assert [k for k, _ in build_settings(config).auth.client_keys()] == ["k1", "k2"]


def test_a_backend_key_from_an_unset_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KNEECAP_TEST_BACKEND_KEY", raising=False)
    config = {"backends": [backend("a", NOWHERE, api_key_env="KNEECAP_TEST_BACKEND_KEY")]}
    assert "KNEECAP_TEST_BACKEND_KEY" in refusal(config)
    monkeypatch.setenv("KNEECAP_TEST_BACKEND_KEY", "secret")
    assert build_settings(config).backends[0].resolved_api_key() == "secret"


@pytest.mark.parametrize(
    "url, words",
    [
        ("ftp://h:21", "must start with http:// or https://"),
        ("http://h:80000", "is not a valid URL"),
        ("http://h:8000x", "is not a valid URL"),
        ("http://[::1", "is not a valid URL"),
        ("http://:8000", "names no host"),
        ("http://h:0", "port 0 is no port"),
        ("http://h :8000", "holds a space"),
        ("http://h:8000/v1?x=1", "no query or fragment"),
        ("http://h:8000#top", "no query or fragment"),
        ("http://h:8000?", "no query or fragment"),
    ],
)
def test_a_backend_url_nothing_could_connect_to_is_refused_at_its_key(url: str, words: str) -> None:
    message = refusal({"backends": [backend("a", url)]})
    assert "backends.0.url" in message and words in message, message


def test_backend_urls_of_every_legal_form_are_taken() -> None:
    urls = ["http://[::1]:8000", "https://h.example", "http://10.0.0.1:8000/", "http://h:1"]
    config = {"backends": [backend(f"b{i}", url) for i, url in enumerate(urls)]}
    assert [b.url for b in build_settings(config).backends] == urls


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"sim": {"ttft_ms": 1}}, "`url` or `sim`"),
        ({"api_key": "k", "api_key_env": "HOME"}, "`api_key` or `api_key_env`"),
        ({"models": [""]}, "models.0"),
    ],
)
def test_a_backend_that_says_two_things_is_refused(extra: dict[str, Any], words: str) -> None:
    assert words in refusal({"backends": [backend("a", NOWHERE, **extra)]})


@pytest.mark.parametrize(
    "first, second",
    [
        (NOWHERE, NOWHERE + "/"),
        (NOWHERE, NOWHERE + "//"),
        ("http://engine.internal", "http://ENGINE.internal:80/"),
        ("https://engine.internal:443", "https://engine.internal"),
    ],
)
def test_two_backends_at_one_engine_are_warned_of(first: str, second: str) -> None:
    config = {"backends": [backend("a", first), backend("b", second)]}
    (warning,) = shared_engines(build_settings(config))
    assert "backends a, b are one engine" in warning


def test_check_config_prints_the_shared_engine_warning(tmp_path: Path) -> None:
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump({"backends": [backend("a", NOWHERE), backend("b", NOWHERE)]}))
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "warning: backends a, b are one engine" in result.stderr


def test_check_config_warns_of_an_empty_file(tmp_path: Path) -> None:
    """An empty file loads (every key has a default), and the gateway then serves nothing."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "warning: no backends configured" in result.stderr


def test_backends_at_other_ports_or_paths_are_not_one_engine() -> None:
    urls = [
        "http://127.0.0.1:9",
        "http://127.0.0.1:10",
        "http://127.0.0.1:9/b",
        "https://127.0.0.1:9",
    ]
    config = {"backends": [backend(f"b{i}", url) for i, url in enumerate(urls)]}
    assert shared_engines(build_settings(config)) == []


def test_a_client_key_in_both_classes_is_refused() -> None:
    keys = ["k", {"key": "k", "priority": "batch"}]
    assert "both interactive and batch" in refusal({"auth": {"api_keys": keys}})


def test_a_key_given_twice_in_a_mapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("auth: {api_keys: [sk-a]}\nbackends: []\nauth: {admin_token: adm}\n")
    with pytest.raises(ConfigError, match="found the key 'auth' twice"):
        load_settings(path)


def test_merge_keys_may_still_override_their_base(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(
        "pools:\n"
        "  short: &base {max_prompt_tokens: 8192, max_queue_depth: 8}\n"
        "  other:\n    <<: *base\n    max_queue_depth: 16\n"
    )
    pools = load_settings(path).pools
    assert (pools["other"].max_prompt_tokens, pools["other"].max_queue_depth) == (8192, 16)


def test_an_empty_config_path_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="config path is empty"):
        load_settings("")
    monkeypatch.setenv("KNEECAP_CONFIG", "")
    with pytest.raises(ConfigError, match="config path is empty"):
        load_settings(None)


def test_errors_in_a_limit_block_name_the_keys_the_file_has() -> None:
    message = refusal({"admission": {"limit": {"ttft_p95_sl0": 1}}})
    assert "admission.limit.ttft_p95_sl0" in message, message
    backends = [backend("a", NOWHERE, limit={"kind": "static", "intial": 4})]
    message = refusal({"backends": backends})
    assert "backends.0.limit.intial" in message, message


def test_five_backends_of_default_limits_fit_the_default_pool() -> None:
    config = {"backends": [backend(f"b{i}", f"http://127.0.0.1:{10 + i}") for i in range(5)]}
    settings = build_settings(config)
    needed = sum(settings.limit_of(b).max for b in settings.backends)
    assert needed > 1024
    assert settings.upstream_connections == needed
    narrow = {**config, "upstream": {"max_connections": 1024}}
    assert "upstream.max_connections" in refusal(narrow)


def test_a_reload_with_a_key_given_twice_keeps_the_old_config(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    try:
        gw = start_gateway(
            tmp_path, {"backends": [backend("a", sim.url)], "auth": {"api_keys": ["sk-a"]}}
        )
        try:
            text = gw.config_path.read_text()
            gw.config_path.write_text(text + "auth: {admin_token: adm}\n")
            response = httpx.post(gw.url + "/admin/reload", timeout=5)
            assert response.status_code == 400, response.text
            assert "twice" in response.json()["message"]
            chat = {"model": "Qwen/Qwen3-4B", "messages": [{"role": "user", "content": "hi"}]}
            keyless = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10)
            assert keyless.status_code == 401  # the keys still hold
        finally:
            gw.proc.stop()
    finally:
        sim.stop()


def test_a_reload_says_a_simulators_model_waits_for_a_restart() -> None:
    from gateway.runtime import _needing_a_restart

    def sim_backend(model: str) -> dict[str, Any]:
        return {"name": "s", "pool": "short", "models": [model], "sim": {"ttft_ms": 1}}

    running = build_settings({"backends": [sim_backend("model-a")]})
    renamed = build_settings({"backends": [sim_backend("model-b")]})
    assert _needing_a_restart(running, renamed) == ["backends.s.models"]
    assert _needing_a_restart(running, running) == []


def test_a_tokenizer_file_that_is_no_tokenizer_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "tokenizer.json"
    junk.write_text('{"not": "a tokenizer"}')
    estimator = {"mode": "tokenizer", "tokenizers": {"m": str(junk)}}
    message = refusal({"routing": {"estimator": estimator}})
    assert "tokenizer for 'm'" in message and "not a tokenizer.json" in message, message


@pytest.mark.parametrize(
    "config, key",
    [
        ({"listen": {"port": False}}, "port"),
        ({"pools": {"short": {"max_queue_depth": False}}}, "max_queue_depth"),
        ({"health": {"interval_s": True}}, "interval_s"),
    ],
)
def test_yes_or_no_where_a_number_is_due_is_refused(config: dict[str, Any], key: str) -> None:
    assert f"`{key}` must be a number" in refusal(config)


def test_yes_or_no_stays_fine_where_it_is_due() -> None:
    assert build_settings({"routing": {"spill": {"to_shorter": True}}}).routing.spill.to_shorter


def test_a_backend_that_never_comes_up_is_logged_with_the_reason(tmp_path: Path) -> None:
    """An OpenAI base URL (`.../v1`) pasted as a backend's url: every request got 503 and
    the log said nothing, since "DOWN" was logged only for a backend that had been up."""
    sim = start_sim(tmp_path, ttft_ms=1, itl_ms=1)
    try:
        gw = start_gateway(tmp_path, {"backends": [backend("a", sim.url + "/v1")]})
        try:
            assert f"backend a is DOWN: GET {sim.url}/v1/health answered 404" in gw.proc.output()
        finally:
            gw.proc.stop()
    finally:
        sim.stop()


def test_a_pool_an_earlier_one_covers_is_warned_of() -> None:
    backends = [backend("g", NOWHERE, "general"), backend("l", "http://127.0.0.1:10", "long")]
    pools = {"general": {}, "long": {"min_prompt_tokens": 2000}}
    (warning,) = config_warnings(build_settings({"pools": pools, "backends": backends}))
    assert "pool 'long' is no request's home while 'general'" in warning
    # The same pools the other way round are fine, and so are pools without backends.
    flipped = {"long": {"min_prompt_tokens": 2000}, "general": {}}
    assert config_warnings(build_settings({"pools": flipped, "backends": backends})) == []
    assert shadowed_pools(build_settings({"pools": pools})) == []


def test_pools_covered_together_are_warned_of_and_pools_per_model_are_not() -> None:
    def config(pools: dict[str, Any], models: dict[str, list[str] | None]) -> dict[str, Any]:
        backends = [
            backend(f"b-{pool}", f"http://127.0.0.1:{10 + i}", pool, models=models[pool] or [])
            for i, pool in enumerate(pools)
        ]
        return {"pools": pools, "backends": backends}

    ranges = {
        "a": {"max_prompt_tokens": 2000},
        "c": {"min_prompt_tokens": 2000},
        "b": {"min_prompt_tokens": 1000, "max_prompt_tokens": 3000},
    }
    same = {"a": ["m"], "c": ["m"], "b": ["m"]}
    (warning,) = config_warnings(build_settings(config(ranges, same)))
    assert "pool 'b' is no request's home while 'a', 'c'" in warning
    # One pool per model: each is its model's home, whatever the ranges.
    per_model = {"llama": {}, "qwen": {}}
    assert config_warnings(build_settings(config(per_model, {"llama": ["l"], "qwen": ["q"]}))) == []
    # A backend that learns its models at run time may share one.
    learnt = config_warnings(build_settings(config(per_model, {"llama": ["l"], "qwen": None})))
    assert len(learnt) == 1


@pytest.mark.parametrize("variable", ["KNEECAP_BACKENDS__0__NAME", "KNEECAP_AUTH__API_KEYS__1"])
def test_a_list_item_set_by_index_from_the_environment_is_refused_by_its_name(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """pydantic-settings said only "backends: Input should be a valid tuple"."""
    monkeypatch.setenv(variable, "x")
    assert f"{variable}: a list is overridden whole, as JSON" in refusal({})


def test_a_pool_named_by_digits_may_still_be_set_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNEECAP_POOLS__1__MAX_QUEUE_DEPTH", "7")
    pools = build_settings({"pools": {"1": {}}}).pools
    assert pools["1"].max_queue_depth == 7


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"listen": {"host": ""}}, "listen.host"),  # asyncio: every interface
        ({"listen": {"host": "  "}}, "listen.host"),  # as the CLI's --host refuses it
        ({"backends": [{"name": "s", "pool": "short", "sim": {"speed": 1e-310}}]}, "sim.speed"),
        ({"backends": [{"name": "s", "pool": "short", "sim": {"speed": 1e4}}]}, "sim.speed"),
    ],
)
def test_an_empty_host_or_an_absurd_sim_speed_is_refused(config: dict, path: str) -> None:
    assert path in refusal(config)


@pytest.mark.parametrize(
    "config",
    [
        {"health": {"interval_s": float("inf")}},  # never a probe again
        {"health": {"timeout_s": float("inf")}},
        {"admission": {"control_interval_s": float("inf")}},
        {"measurement": {"scrape_interval_s": float("inf")}},
    ],
)
def test_a_loop_interval_that_never_comes_round_is_refused(config: dict[str, Any]) -> None:
    ((section, values),) = config.items()
    ((key, _),) = values.items()
    message = refusal(config)
    assert f"{section}.{key}" in message and "finite" in message, message


@pytest.mark.parametrize("fixed", [{"ttft_ms": 5}, {"itl_ms": 3}, {"ttft_ms": 50, "itl_ms": 15}])
def test_fixed_latencies_beside_a_sim_profile_are_refused(fixed: dict[str, float]) -> None:
    """Before, the profile's engine ran and the latencies were dropped without a word."""
    sim = {"profile": "qwen3-4b/l40s/bf16/vllm", **fixed}
    message = refusal({"backends": [{"name": "s", "sim": sim}]})
    assert "backends.0.sim" in message and "fixed-latency engine" in message, message
    assert " and ".join(sorted(fixed)) in message


def test_a_sim_profile_alone_or_latencies_alone_are_taken() -> None:
    backends = [
        {"name": "p", "sim": {"profile": "qwen3-4b/l40s/bf16/vllm"}},
        {"name": "f", "sim": {"ttft_ms": 5, "itl_ms": 2}},
    ]
    sims = [b.sim for b in build_settings({"backends": backends}).backends]
    assert [(s.profile, s.ttft_ms, s.itl_ms) for s in sims] == [
        ("qwen3-4b/l40s/bf16/vllm", 50.0, 15.0),
        (None, 5.0, 2.0),
    ]
