"""deploy/ cannot run here (no container engine), so check what can be checked statically:
every file parses, the gateway configs validate, and the files agree on names and paths."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from backends.sim.profiles import get_profile
from gateway.cli import build_parser
from gateway.settings import Settings, build_settings
from tests.prom import find_binary

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "compose"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose(name: str) -> dict[str, Any]:
    services: dict[str, Any] = load(COMPOSE / name)["services"]
    return services


def test_every_yaml_file_parses() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 8
    for path in files:
        assert all(doc is not None for doc in yaml.safe_load_all(path.read_text())), path


def test_compose_gateway_config_validates_and_names_compose_services() -> None:
    settings = build_settings(load(COMPOSE / "kneecap.yaml"))
    assert {b.pool for b in settings.backends} == {"short", "long"}
    for file in ("docker-compose.yml", "docker-compose.sim.yml"):
        services = compose(file)
        for backend in settings.backends:
            url = urlsplit(backend.url or "")
            assert url.hostname in services, f"{file}: no service {url.hostname}"
            command = " ".join(map(str, services[url.hostname]["command"]))
            assert f"--port={url.port}" in command, f"{file}: {backend.name} not on {url.port}"
        kneecap = services["kneecap"]
        assert "./kneecap.yaml:/etc/kneecap/kneecap.yaml:ro" in kneecap["volumes"]
        assert kneecap["environment"]["KNEECAP_CONFIG"] == "/etc/kneecap/kneecap.yaml"


def test_real_compose_reserves_a_gpu_per_engine_and_sim_needs_none() -> None:
    services = compose("docker-compose.yml")
    gpus = []
    for name in ("vllm-0", "vllm-1", "sglang-0"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert "Qwen/Qwen3-4B" in " ".join(services[name]["command"])
    assert len(set(gpus)) == 3, "each engine on its own GPU by default"
    assert "--enable-metrics" in services["sglang-0"]["command"]
    assert all("deploy" not in s for s in compose("docker-compose.sim.yml").values())


def test_monitoring_files_agree() -> None:
    scrape = load(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    (job,) = [j for j in scrape if j["job_name"] == "kneecap"]
    assert job["static_configs"][0]["targets"] == ["kneecap:8000"]
    (datasource,) = load(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert datasource["uid"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = load(DEPLOY / "grafana/provisioning/dashboards/kneecap.yml")["providers"]
    for file in ("docker-compose.yml", "docker-compose.sim.yml"):
        services = compose(file)
        grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
        assert grafana_mounts["../grafana/dashboards"] == provider["options"]["path"]
        for volume in services["grafana"]["volumes"] + services["prometheus"]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{file}: {source} missing"


def test_kubernetes_manifests_fit_together() -> None:
    gateway_docs = list(yaml.safe_load_all((DEPLOY / "kubernetes/kneecap.yaml").read_text()))
    engine_docs = list(yaml.safe_load_all((DEPLOY / "kubernetes/vllm.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in gateway_docs + engine_docs}
    config = kinds[("ConfigMap", "kneecap-config")]["data"]["kneecap.yaml"]
    settings: Settings = build_settings(yaml.safe_load(config))
    for backend in settings.backends:
        host = urlsplit(backend.url or "").hostname
        assert ("Service", host) in kinds, f"no Service for backend {backend.name}"
        assert ("Deployment", host) in kinds
    pod = kinds[("Deployment", "kneecap")]["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"


def test_dockerfile_installs_the_package_on_python_311_slim() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert "pip install ." in text
    assert 'ENTRYPOINT ["kneecap"]' in text


def with_compose_defaults(arg: str) -> str:
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def test_every_kneecap_command_line_parses_with_the_cli() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile, flags=re.MULTILINE)
    commands = [json.loads(cmd)]
    for file in ("docker-compose.yml", "docker-compose.sim.yml"):
        for service in compose(file).values():
            if service.get("image") == "kneecap:local":
                commands.append([with_compose_defaults(a) for a in service["command"]])
    pod = list(yaml.safe_load_all((DEPLOY / "kubernetes/kneecap.yaml").read_text()))[1]
    commands.append(pod["spec"]["template"]["spec"]["containers"][0]["args"])
    assert len(commands) >= 6
    for command in commands:
        args = build_parser().parse_args(command)
        if args.command == "sim":
            assert get_profile(args.profile).flavor == args.engine, command


@pytest.mark.prometheus
def test_promtool_accepts_the_shipped_prometheus_config() -> None:
    promtool = find_binary("promtool")
    done = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(DEPLOY / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
