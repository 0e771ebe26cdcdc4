"""docker-compose.yml, checked statically (Docker cannot run on this machine kind): in both
profiles a ``redis`` service and two gateway replicas in fleet mode behind an nginx balancer
on port 8000; every command, config file, env override, service name and port they
reference exists and agrees. What running it needs (issue 15 item 6): vLLM in dev mode with
sleep mode where the config sleeps, pinned images, restart policies, healthchecks behind
every ``service_healthy`` dependency, dcgm-exporter beside the GPU services (the config's
``gpu_metrics_url``), the admin key from the environment, the ``sim`` profile without GPUs.
And ``.ci/run`` installs the Redis server the fleet tests use."""

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
from gateway.fleet import telemetry

ROOT = Path(__file__).resolve().parents[2]
# what `docker compose` reads from the environment (or .env) in these checks
COMPOSE_ENV = {"GATEWAY_ADMIN_KEY": "admin-key-from-env"}
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


class Unset(Exception):
    """A required variable (``${VAR:?message}``) is unset: compose stops with ``message``."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """``value`` as compose substitutes it from ``env``: ``${VAR}``, ``${VAR:-default}``,
    ``${VAR:?message}`` (unset or empty: :class:`Unset`); ``$$`` is a literal ``$``."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        got = env.get(name, "")
        if op == ":?" and not got:
            raise Unset(f"{name}: {arg}")
        if op == ":-" and not got:
            return arg
        return got

    return re.sub(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}", one, value)


def replica_config(svc: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                   env: dict[str, str] | None = None) -> GatewayConfig:
    """The config a replica service runs: its file (the Dockerfile copies config/ to
    /app/config/) under its ``LLM_GATEWAY_*`` environment, interpolated from ``env``
    (default :data:`COMPOSE_ENV`)."""
    args = build_parser().parse_args(svc["command"])
    assert args.command == "serve" and args.config.startswith("/app/config/")
    with monkeypatch.context() as m:
        for k, v in svc.get("environment", {}).items():
            if k.startswith("LLM_GATEWAY_"):
                m.setenv(k, interpolate(str(v), COMPOSE_ENV if env is None else env))
        return load_config(ROOT / args.config.removeprefix("/app/"))


def published(svc: dict[str, Any]) -> list[tuple[int, int]]:
    """(host port, container port) of each ``[ip:]host:container`` entry."""
    return [(int(p.split(":")[-2]), int(p.split(":")[-1])) for p in svc.get("ports", [])]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_replica_ports_are_published_on_the_loopback_only(profile):
    """Each replica's own port (its /admin, /metrics) is for this host: README
    "Security"; only the balancer's 8000 faces the network."""
    svcs = services()
    _, pair, _ = PROFILES[profile]
    for name in pair:
        ports = svcs[name]["ports"]
        assert ports and all(p.startswith("127.0.0.1:") for p in ports), (name, ports)


def test_default_profile_runs_redis_two_replicas_and_gpu_vllm():
    svcs = services()
    default = {n for n, s in svcs.items() if not s.get("profiles")}
    assert default == {"redis", "gateway", "gateway-1", "gateway-2", "vllm-a", "vllm-b",
                       "dcgm-exporter"}
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


# ---- what running it needs (issue 15 item 6) ----------------------------------------------

def healthcheck_cmd(svc: dict[str, Any]) -> str:
    test = svc["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return " ".join(test[1:])


@pytest.mark.parametrize("name", ["vllm-a", "vllm-b"])
def test_vllm_runs_in_dev_mode_with_sleep_mode_where_the_config_sleeps(name, monkeypatch):
    """The medium cycle's ``POST /reset_prefix_cache`` (and ``/sleep``, ``/wake_up``) exist
    only with ``VLLM_SERVER_DEV_MODE=1``; the config the replicas run puts vLLM to sleep
    (``lifecycle.medium.sleep``), so vLLM runs with ``--enable-sleep-mode``. Its image is a
    pinned release, and its port is published nowhere (dev-mode routes are for the gateway
    only)."""
    svcs = services()
    vllm = svcs[name]
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    cfg = replica_config(svcs["gateway-1"], monkeypatch)
    assert cfg.lifecycle.medium.sleep is True
    assert "--enable-sleep-mode" in vllm["command"]
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", vllm["image"]), vllm["image"]
    assert "ports" not in vllm
    assert "/health" in healthcheck_cmd(vllm)


def test_pulled_images_are_pinned_and_every_service_restarts():
    """Every image pulled from a registry names a tag other than ``latest`` (the gateway's
    own image is built here); every service has a restart policy."""
    for name, svc in services().items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
        if "build" in svc:
            continue
        image = svc["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", (name, image)


def test_images_both_deployments_share_are_the_same_release():
    """Redis and vLLM (and dcgm-exporter) run the same pinned release in compose as in the
    Kubernetes manifests (``deploy/kubernetes/``): "pinned" means one version, and a
    floating tag such as ``redis:7-alpine`` would be another release on every pull."""
    in_kube: dict[str, str] = {}
    for path in sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) if isinstance(spec, dict) else []:
                repo, _, tag = c["image"].rpartition(":")
                in_kube[repo] = tag
    compared = 0
    for name, svc in services().items():
        if "build" in svc:
            continue
        repo, _, tag = svc["image"].rpartition(":")
        if repo in in_kube:
            assert tag == in_kube[repo], (name, svc["image"], in_kube[repo])
            compared += 1
    assert compared >= 3  # redis, the two vLLM services, dcgm-exporter


def test_dependencies_wait_for_health_and_healthchecks_probe_the_right_thing(monkeypatch):
    """Every ``depends_on`` entry names its condition; a dependency with a healthcheck is
    waited for until healthy (and ``service_healthy`` only on one that has a healthcheck):
    Redis by ``redis-cli ping``, vLLM and the simulators by ``/health``, the gateway replicas
    by ``/health`` on their own port."""
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on without conditions"
        for dep, how in deps.items():
            want = "service_healthy" if "healthcheck" in svcs[dep] else "service_started"
            assert how == {"condition": want}, (name, dep, how)
    assert healthcheck_cmd(svcs["redis"]) == "redis-cli ping"
    for profile, (_lb, pair, backends) in PROFILES.items():
        for name in pair:
            port = replica_config(svcs[name], monkeypatch).server.port
            assert f"127.0.0.1:{port}/health" in healthcheck_cmd(svcs[name]), (profile, name)
            assert svcs[name]["depends_on"]["redis"] == {"condition": "service_healthy"}
        for name in backends:
            assert "127.0.0.1:8000/health" in healthcheck_cmd(svcs[name]), name


def test_dcgm_exporter_beside_the_gpus_feeds_the_configs_gpu_metrics(monkeypatch):
    """dcgm-exporter (a pinned ``nvcr.io/nvidia/k8s/dcgm-exporter`` tag) runs in the GPU
    profile with the vLLM services' GPUs; each backend's ``gpu_metrics_url`` is that service
    on its port 9400 and ``gpu_indices`` its vLLM service's GPU; the collectors file it is
    given exists and selects every DCGM field the gateway reads."""
    svcs = services()
    dcgm = svcs["dcgm-exporter"]
    assert re.fullmatch(r"nvcr\.io/nvidia/k8s/dcgm-exporter:\d+\.\d+\.\d+-\d+\.\d+\.\d+-\S+",
                        dcgm["image"]), dcgm["image"]
    assert "SYS_ADMIN" in dcgm["cap_add"] and "ports" not in dcgm
    gpus = dcgm["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    cfg = replica_config(svcs["gateway-1"], monkeypatch)
    for b in cfg.backends:
        u = urlsplit(str(b.gpu_metrics_url))
        assert (u.hostname, u.port, u.path) == ("dcgm-exporter", 9400, "/metrics"), b.id
        devices = svcs[urlsplit(b.base_url).hostname]["deploy"]["resources"]["reservations"]
        assert [str(i) for i in b.gpu_indices or []] == devices["devices"][0]["device_ids"]
        assert set(devices["devices"][0]["device_ids"]) <= set(gpus)
    assert all("dcgm-exporter" in svcs[n]["depends_on"] for n in PROFILES["default"][1])
    args = dcgm["command"]
    collectors = args[args.index("-f") + 1]
    (mount,) = [v for v in dcgm["volumes"] if v.split(":")[1] == collectors]
    fields = {line.split(",")[0].strip()
              for line in (ROOT / mount.split(":")[0]).read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    read = {telemetry.DCGM_TEMP, telemetry.DCGM_POWER, telemetry.DCGM_POWER_LIMIT,
            telemetry.DCGM_ENFORCED_LIMIT, telemetry.DCGM_SM_CLOCK, telemetry.DCGM_XID,
            telemetry.DCGM_ECC_DBE}
    assert read <= fields, read - fields


def test_sim_profile_needs_no_gpu():
    """``docker compose --profile sim up gateway-sim`` starts nothing that reserves a GPU
    (no vLLM, no dcgm-exporter)."""
    svcs = services()
    for name in started_by("gateway-sim"):
        assert "deploy" not in svcs[name], name
    assert not {"vllm-a", "vllm-b", "dcgm-exporter"} & started_by("gateway-sim")


def test_admin_key_comes_from_the_environment_never_unset(monkeypatch):
    """Each replica's admin key is ``${VAR:?message}``: set, it guards the admin API (the
    loaded config's key); unset, compose stops with the message instead of publishing an
    open admin API. No literal key in the file."""
    svcs = services()
    for profile, (_lb, pair, _b) in PROFILES.items():
        for name in pair:
            raw = svcs[name]["environment"]["LLM_GATEWAY_AUTH__ADMIN_KEY"]
            assert re.fullmatch(r"\$\{(\w+):\?[^}]+\}", raw), (profile, name, raw)
            cfg = replica_config(svcs[name], monkeypatch)
            assert cfg.auth.resolved_admin_key() == COMPOSE_ENV["GATEWAY_ADMIN_KEY"]
            with pytest.raises(Unset, match="GATEWAY_ADMIN_KEY"):
                replica_config(svcs[name], monkeypatch, env={})
