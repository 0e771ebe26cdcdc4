"""docker-compose.yml, checked statically (Docker cannot run on this machine kind): in both
profiles a ``redis`` service and two gateway replicas in fleet mode behind an nginx balancer
on port 8000; every command, config file, env override, service name and port they
reference exists and agrees. And ``.ci/run`` installs the Redis server the fleet tests use."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import GatewayConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {
    # profile -> (balancer, its two replicas, the backends' services)
    "default": ("gateway", ("gateway-1", "gateway-2"), ("vllm-a", "vllm-b")),
    "sim": ("gateway-sim", ("gateway-sim-1", "gateway-sim-2"), ("sim-a", "sim-b")),
}


def services() -> dict[str, Any]:
    out: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return out


def in_profile(profile: str) -> set[str]:
    """Services ``docker compose [--profile P] up`` starts: those without profiles (the
    default) plus, with ``--profile sim``, the sim profile's."""
    return {n for n, s in services().items()
            if not s.get("profiles") or profile in s.get("profiles", [])}


def started_by(name: str) -> set[str]:
    """``name`` and everything it depends on, transitively (what ``up <name>`` starts)."""
    svcs, todo, seen = services(), [name], set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(svcs[n].get("depends_on", []))
    return seen


def replica_config(svc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> GatewayConfig:
    """The config a replica service runs: its file (the Dockerfile copies config/ to
    /app/config/) under its ``LLM_GATEWAY_*`` environment."""
    args = build_parser().parse_args(svc["command"])
    assert args.command == "serve" and args.config.startswith("/app/config/")
    with monkeypatch.context() as m:
        for k, v in svc.get("environment", {}).items():
            if k.startswith("LLM_GATEWAY_"):
                m.setenv(k, str(v))
        return load_config(ROOT / args.config.removeprefix("/app/"))


def published(svc: dict[str, Any]) -> list[tuple[int, int]]:
    return [(int(p.split(":")[0]), int(p.split(":")[1])) for p in svc.get("ports", [])]


def test_default_profile_runs_redis_two_replicas_and_gpu_vllm():
    svcs = services()
    default = {n for n, s in svcs.items() if not s.get("profiles")}
    assert default == {"redis", "gateway", "gateway-1", "gateway-2", "vllm-a", "vllm-b"}
    for name in ("vllm-a", "vllm-b"):
        devices = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    sim = {n for n, s in svcs.items() if "sim" in s.get("profiles", [])}
    assert sim == {"gateway-sim", "gateway-sim-1", "gateway-sim-2", "sim-a", "sim-b"}
    assert svcs["redis"]["image"].startswith("redis:7")
    assert "--save" in svcs["redis"]["command"]  # no persistence: replicas write state back


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replicas_are_fleet_mode_gateways_on_the_redis_service(profile, monkeypatch):
    svcs = services()
    balancer, pair, backends = PROFILES[profile]
    assert {balancer, "redis", *pair, *backends} <= started_by(balancer)
    ids = set()
    for name in pair:
        svc = svcs[name]
        assert svc["build"] == "." and (ROOT / "Dockerfile").exists()
        cfg = replica_config(svc, monkeypatch)
        assert cfg.coordination.enabled
        store = urlsplit(cfg.coordination.redis_url or "")
        assert store.scheme == "redis" and store.hostname == "redis"
        assert (store.port or 6379) == 6379
        assert "redis" in svc["depends_on"]
        ids.add(cfg.coordination.replica_id)
        assert cfg.server.host == "0.0.0.0"  # reachable from the balancer
        assert [inner for _host, inner in published(svc)] == [cfg.server.port]
        for b in cfg.backends:  # the backends are services it waits for
            u = urlsplit(b.base_url)
            assert u.hostname in backends and u.hostname in svc["depends_on"]
            cmd = svcs[u.hostname]["command"]
            assert int(cmd[cmd.index("--port") + 1]) == u.port
    assert len(ids) == 2 and None not in ids  # distinct replica ids


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_balancer_reaches_both_replicas_on_port_8000(profile, monkeypatch):
    svcs = services()
    balancer, pair, _ = PROFILES[profile]
    lb = svcs[balancer]
    assert lb["image"].startswith("nginx:")
    assert published(lb) == [(8000, 8000)]
    assert lb["environment"] == {"REPLICA_1": pair[0], "REPLICA_2": pair[1]}
    assert set(lb["depends_on"]) == set(pair)
    (mount,) = lb["volumes"]
    src, dest, _mode = mount.split(":")
    assert dest.startswith("/etc/nginx/templates/") and dest.endswith(".template")
    template = (ROOT / src).read_text()
    port = replica_config(svcs[pair[0]], monkeypatch).server.port
    servers = re.findall(r"^\s*server\s+(\S+?):(\d+)", template, re.M)
    assert servers == [("${REPLICA_1}", str(port)), ("${REPLICA_2}", str(port))]
    assert re.search(r"^\s*listen\s+8000;", template, re.M)
    assert "proxy_buffering off;" in template  # streams relayed event by event
    # host ports of the services one `up` starts never clash
    host_ports = [h for n in started_by(balancer) for h, _ in published(svcs[n])]
    assert len(host_ports) == len(set(host_ports))


def test_sim_services_use_valid_cli():
    svcs = services()
    for name in ("sim-a", "sim-b"):
        args = build_parser().parse_args(svcs[name]["command"])
        assert args.command == "sim" and args.host == "0.0.0.0"


def test_ci_installs_redis_server_when_missing():
    text = (ROOT / ".ci" / "run").read_text()
    assert "command -v redis-server" in text
    assert re.search(r"apt-get update", text) and re.search(
        r"apt-get install -y[^\n]*redis-server", text)
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
