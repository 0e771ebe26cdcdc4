"""Docker cannot run on this machine kind, so the Dockerfile is checked statically: every
file, port, command and config key it references must exist (docker-compose.yml:
``test_compose.py``)."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

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


# docker-compose.yml: tests/unit/test_compose.py
