"""Docker cannot run on this machine kind, so the Dockerfile and docker-compose.yml are
checked statically: every file, port, command and config key they reference must exist."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


def app_paths() -> set[str]:
    from gateway.app import create_app

    return {getattr(r, "path", "") for r in create_app(load_config(None)).routes}


def test_dockerfile_references_exist_and_image_is_slim_non_root():
    ins = dockerfile_instructions()
    froms = [a for op, a in ins if op == "FROM"]
    assert froms and all("slim" in f for f in froms)
    for op, arg in ins:
        if op == "COPY" and not arg.startswith("--from"):
            *sources, _dest = arg.split()
            for s in sources:
                assert (ROOT / s).exists(), f"COPY source {s} missing"
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1] not in ("0", "root")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = exec_form(next(a for op, a in ins if op == "ENTRYPOINT"))
    assert entry[0] in scripts
    cmd = exec_form(next(a for op, a in ins if op == "CMD"))
    args = build_parser().parse_args(cmd)  # the subcommand and flags exist
    cfg = load_config(ROOT / args.config.replace("/app/", ""))
    exposed = {int(a) for op, a in ins if op == "EXPOSE"}
    assert cfg.server.port in exposed
    health = next(a for op, a in ins if op == "HEALTHCHECK")
    # the port the server listens on: the env override, else the config's
    assert "127.0.0.1:{port}/health" in health
    assert f"'LLM_GATEWAY_SERVER__PORT', '{cfg.server.port}'" in health
    assert "/health" in app_paths()


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def service_port(svc: dict) -> int:
    cmd = svc["command"]
    return int(cmd[cmd.index("--port") + 1])


def test_compose_default_is_gateway_beside_two_gpu_vllm_services():
    services = compose()["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"gateway", "vllm-a", "vllm-b"}
    for name in ("vllm-a", "vllm-b"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    sim = {n for n, s in services.items() if "sim" in s.get("profiles", [])}
    assert sim == {"gateway-sim", "sim-a", "sim-b"}


@pytest.mark.parametrize("gateway_service", ["gateway", "gateway-sim"])
def test_compose_gateway_config_matches_services(gateway_service):
    services = compose()["services"]
    gw = services[gateway_service]
    assert gw["build"] == "." and (ROOT / "Dockerfile").exists()
    args = build_parser().parse_args(gw["command"])
    assert args.config.startswith("/app/config/")  # the Dockerfile copies config/ there
    cfg = load_config(ROOT / args.config.removeprefix("/app/"))  # every key validates
    published = [int(p.split(":")[1]) for p in gw["ports"]]
    assert published == [cfg.server.port]
    assert cfg.server.host == "0.0.0.0"  # reachable from other containers
    deps = gw["depends_on"]
    for b in cfg.backends:
        u = urlsplit(b.base_url)
        assert u.hostname in services, f"{b.id}: no compose service {u.hostname}"
        assert u.hostname in deps
        assert service_port(services[u.hostname]) == u.port


def test_compose_sim_services_use_valid_cli():
    services = compose()["services"]
    for name in ("sim-a", "sim-b"):
        args = build_parser().parse_args(services[name]["command"])
        assert args.command == "sim" and args.host == "0.0.0.0"
