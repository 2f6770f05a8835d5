"""The command line: check-config, env overrides, and `kneecap serve` on its embedded default."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from gateway.settings import ConfigError, load_settings
from tests.procs import MODEL, STARTED, Proc, free_port, start_process, wait_until


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_check_config_accepts_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:9', pool: long}\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert "pool long" in result.stdout and "a" in result.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("backends:\n  - {name: a, url: 'http://x', pool: nope}\n", "pool 'nope'"),
        ("listen: {port: high}\n", "listen.port"),
        ("backends:\n  - {name: a}\n", "backends.0"),
        ("pools: {short: {max_queue_depth: -1}}\n", "pools.short.max_queue_depth"),
        ("surprise: 1\n", "surprise"),
        ("[1, 2]\n", "top level must be a mapping"),
        # An empty key let in every client that sent none; an empty admin token read as
        # none at all (the admin API open).
        ("auth: {api_keys: ['']}\n", "a client key must not be empty"),
        ("auth: {api_keys: [{key: ' '}]}\n", "a client key must not be empty"),
        ("auth: {admin_token: ''}\n", "admin_token must not be empty"),
        # Appended to the URL, "health" probed http://host:porthealth: every backend down.
        ("health: {path: health}\n", "health.path"),
        # Passed, then `kneecap serve` died on a KeyError traceback.
        ("backends:\n  - {name: s, sim: {profile: nope}}\n", "unknown simulator profile 'nope'"),
        ("admission: {limit: {kind: fast}}\n", "admission.limit: `kind` must be one of"),
        # Served sglang: names while the gateway read vllm: ones, engine gauges never seen.
        (
            "backends:\n  - {name: s, engine: vllm, sim: {profile: qwen3-4b/l40s/bf16/sglang}}\n",
            "engine 'vllm' contradicts sim profile 'qwen3-4b/l40s/bf16/sglang'",
        ),
        # One pool for all backends: two at limit 2 need 4 connections (two got 504).
        (
            "upstream: {max_connections: 2}\n"
            "admission: {limit: {kind: static, initial: 2, max: 2}}\n"
            "backends: [{name: a, url: 'http://127.0.0.1:1'}, {name: b, url: 'http://127.0.0.1:2'}]\n",
            "sum of the backends' largest concurrency limits (4)",
        ),
    ],
)
def test_check_config_names_the_bad_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    assert expected in result.stderr


def test_a_simulated_profile_names_the_backends_engine(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("backends:\n  - {name: s, sim: {profile: qwen3-4b/l40s/bf16/sglang}}\n")
    assert load_settings(path).backends[0].engine == "sglang"


def test_a_limit_without_kind_is_the_default_knee_controller(tmp_path: Path) -> None:
    # README: `kind: knee` is the default; a block without it was refused.
    path = tmp_path / "c.yaml"
    path.write_text(
        "admission: {limit: {max: 64}}\n"
        "backends: [{name: a, url: 'http://127.0.0.1:1', limit: {initial: 2}}]\n"
    )
    settings = load_settings(path)
    assert (settings.admission.limit.kind, settings.admission.limit.max) == ("knee", 64)
    assert settings.backends[0].limit is not None and settings.backends[0].limit.kind == "knee"


def test_an_error_in_a_keyed_client_names_its_path_plainly(tmp_path: Path) -> None:
    # The first line was pydantic's own name for a union branch ("lax-or-strict[...]"),
    # about the plain-string form nobody wrote, before the line that mattered.
    path = tmp_path / "bad.yaml"
    path.write_text("auth: {api_keys: [{key: k, priority: urgent}]}\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 1
    errors = result.stderr.splitlines()[1:]
    assert errors == ["auth.api_keys.0.priority: Input should be 'interactive' or 'batch'"]


def test_an_environment_override_of_one_nested_knob_keeps_the_defaults_around_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One pool's knob from the environment replaced the default pools with that pool
    # alone (the long pool gone, the short one's range lost), and one knob of the default
    # limit controller was refused for want of its `kind`.
    path = tmp_path / "c.yaml"
    path.write_text("backends: [{name: a, url: 'http://127.0.0.1:1', pool: long}]\n")
    monkeypatch.setenv("KNEECAP_POOLS__SHORT__MAX_QUEUE_DEPTH", "100")
    monkeypatch.setenv("KNEECAP_ADMISSION__LIMIT__MAX", "64")
    settings = load_settings(path)
    pools = {
        n: (p.min_prompt_tokens, p.max_prompt_tokens, p.max_queue_depth)
        for n, p in settings.pools.items()
    }
    assert pools == {"short": (0, 8192, 100), "long": (8192, None, 256)}
    assert (settings.admission.limit.kind, settings.admission.limit.max) == ("knee", 64)


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: {port: 9000}\nbackends: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    monkeypatch.setenv("KNEECAP_LISTEN__PORT", "9100")
    monkeypatch.setenv("KNEECAP_HEALTH__INTERVAL_S", "0.25")
    settings = load_settings(path)
    assert settings.listen.port == 9100 and settings.health.interval_s == 0.25
    assert settings.backends[0].name == "a"
    monkeypatch.setenv("KNEECAP_LISTEN__PORT", "not-a-port")
    with pytest.raises(ConfigError, match=r"listen\.port"):
        load_settings(path)


def test_settings_are_frozen() -> None:
    settings = load_settings(None)
    with pytest.raises(Exception, match="frozen"):
        settings.listen.port = 1  # type: ignore[misc]


def test_serve_runs_the_embedded_default_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    proc = start_process(
        ["serve", "--port", str(port)], f"http://127.0.0.1:{port}", "/ready", tmp_path / "serve.log"
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == 5
        state = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=5).json()
        pools = sorted(b["pool"] for b in state["backends"])
        assert pools == ["long", "short", "short"]
    finally:
        code = proc.stop(signal.SIGINT)
    assert code == 0, proc.output()
    output = proc.output()
    assert 'OpenAI(base_url="http://127.0.0.1:' in output
    assert "Traceback" not in output


def test_a_second_ctrl_c_stops_the_embedded_default_at_once(tmp_path: Path) -> None:
    # The gateway stopped at once, then its embedded sims gave the stream it had just cut
    # uvicorn's 10 s grace before exiting.
    port = free_port()
    proc = start_process(
        ["serve", "--port", str(port)], f"http://127.0.0.1:{port}", "/ready", tmp_path / "s.log"
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    body |= {"max_tokens": 3000, "ignore_eos": True}  # ~45 s at the embedded sims' pace
    received: list[int] = []

    def read_the_stream() -> None:  # a client reading on, as the SDK would
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        try:
            with httpx.stream("POST", url, json=body, timeout=30) as stream:
                for chunk in stream.iter_bytes():
                    received.append(len(chunk))
        except httpx.HTTPError:
            pass  # cut: that is what the second Ctrl-C asks for

    reader = threading.Thread(target=read_the_stream)
    reader.start()
    try:
        wait_until(lambda: received)
        proc.process.send_signal(signal.SIGINT)
        wait_until(lambda: "draining" in proc.output())
        proc.process.send_signal(signal.SIGINT)
        proc.process.wait(timeout=5)
    finally:
        proc.stop()
        reader.join(30)


def test_ctrl_c_stops_a_simulated_bench_sweep_at_once() -> None:
    # A simulated point never awaited: SIGINT (a cancellation under anyio) waited for the
    # whole sweep, ~a minute for this one.
    command = [sys.executable, "-m", "gateway.cli", "bench", "--sim", "qwen3-4b/l40s/bf16/vllm"]
    sweep_args = ["--concurrency", "32,64,96,128", "--requests", "6000", "--output-tokens", "2816"]
    sweep = subprocess.Popen(
        [*command, *sweep_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert sweep.stdout is not None
        assert sweep.stdout.read(1)  # the sweep has started talking: it is under way
        sweep.send_signal(signal.SIGINT)
        assert sweep.wait(timeout=15) == 130
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("serve", "--port", "99999"), "is not a port"),  # listened on 99999 - 65536
        (("sim", "--port", "70000"), "is not a port"),
        (("serve", "--log-level", "loud"), "invalid choice: 'loud'"),  # KeyError in uvicorn
        (("sim", "--speed", "0"), "is not a positive number"),  # ZeroDivisionError
        (("sim", "--profile", "no/such/profile"), "unknown simulator profile"),  # KeyError
        (("bench", "--sim", "qwen3-4b/l40s/bf16/vllm", "--concurrency", ""), "at least one"),
    ],
)
def test_bad_command_line_values_are_one_line_not_a_traceback(args: tuple, said: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert said in result.stderr and "Traceback" not in result.stderr


def test_an_environment_override_that_is_no_json_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("backends: []\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KNEECAP_AUTH__API_KEYS": "sk-a,sk-b"},  # JSON is due: ["sk-a"]
    )
    assert result.returncode == 1
    assert "auth" in result.stderr and "Traceback" not in result.stderr


def test_serve_on_a_port_in_use_exits_without_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", str(port))
    assert result.returncode != 0
    assert "address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_warns_of_an_override_that_names_no_setting(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("auth: {api_keys_env: KNEECAP_CLIENT_KEYS}\n")
    env = {
        **os.environ,
        "KNEECAP_HEALHT__INTERVAL_S": "1",  # misspelt: the gateway would probe every 2 s
        "kneecap_listne__port": "9000",
        # Not warned of: the gateway's own, a name the config gives, Kubernetes' links.
        "KNEECAP_HEALTH__INTERVAL_S": "1",
        "KNEECAP_CLIENT_KEYS": "k1",
        "KNEECAP_PORT": "tcp://10.0.0.9:8000",
        "KNEECAP_PORT_8000_TCP_ADDR": "10.0.0.9",
        "KNEECAP_SERVICE_HOST": "10.0.0.9",
    }
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    warned = [line.split()[2] for line in result.stderr.splitlines() if "names no setting" in line]
    assert warned == ["KNEECAP_HEALHT__INTERVAL_S", "kneecap_listne__port"], result.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def _announced_url(args: list[str], marker: str, log: Path) -> tuple[Proc, str]:
    """Starts ``kneecap ARGS`` and returns the URL its startup line, ``MARKER…URL``, gives."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parent.parent,
    )
    proc = Proc(process, "", log)
    STARTED.append(proc)  # stopped by the conftest fixtures should an assert fail first

    def line() -> str | None:
        return next((x for x in proc.output().splitlines() if marker in x), None)

    wait_until(lambda: line() is not None or process.poll() is not None, timeout=30)
    found = line()
    assert found is not None, proc.output()
    return proc, found.split(marker, 1)[1].split()[0].strip('",')


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_banner_gives_a_usable_url_for_ipv6_and_port_0(tmp_path: Path) -> None:
    # It printed http://::1:18439/v1 (no brackets) and, for --port 0, port 0.
    path = tmp_path / "c.yaml"
    path.write_text("backends:\n  - {name: a, url: 'http://127.0.0.1:9', models: [m]}\n")
    args = ["serve", "--config", str(path), "--host", "::1", "--port", "0"]
    proc, base_url = _announced_url(args, "OpenAI(base_url=", tmp_path / "serve.log")
    try:
        assert base_url.startswith("http://[::1]:") and not base_url.endswith(":0/v1"), base_url
        assert httpx.get(base_url + "/models", timeout=5).status_code == 200
    finally:
        proc.stop()


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_kneecap_sim_announces_the_port_it_bound(tmp_path: Path) -> None:
    args = ["sim", "--host", "::1", "--port", "0"]
    proc, url = _announced_url(args, ") on ", tmp_path / "sim.log")
    try:
        assert url.startswith("http://[::1]:") and not url.endswith(":0"), url
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        assert proc.stop(signal.SIGINT) == 0, proc.output()


@pytest.mark.parametrize("flags", [["--ttft-ms", "5"], ["--itl-ms", "3"]])
def test_sim_refuses_fixed_latencies_beside_a_profile(flags: list[str]) -> None:
    result = run_cli("sim", "--port", "0", "--profile", "qwen3-4b/l40s/bf16/vllm", *flags)
    assert result.returncode == 2
    assert f"{flags[0]} set a fixed-latency engine" in result.stderr, result.stderr


def test_check_config_names_a_file_nested_too_deeply(tmp_path: Path) -> None:
    """PyYAML builds nested lists recursively: a traceback, before, not the file's name."""
    path = tmp_path / "deep.yaml"
    path.write_text("backends: " + "[" * 5000 + "]" * 5000 + "\n")
    result = run_cli("check-config", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{path}: nested too deeply to be a config" in result.stderr + result.stdout
