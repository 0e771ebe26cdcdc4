"""Small things a new user met (issue 13, item 7), each a kind:

- a server that cannot listen says where and why, in one line (``serve``, ``demo``, ``sim``);
- a command reads only the config file it was given or finds where the user works, and says
  which (never the repository's demo file by accident);
- a request the gateway refuses itself is counted under its model when some backend serves
  that model.

The command line runs as a user runs it: a subprocess in a temporary directory outside the
repository, with no ``LLM_GATEWAY_*`` variable but those the test sets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


# ---- running the command line --------------------------------------------------------------


def llm_gateway(
    *argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``llm-gateway argv`` in ``cwd`` with the environment minus every ``LLM_GATEWAY_*``
    variable, plus ``env``; its exit status, stdout and stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLM_GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 another process (this test) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    """A port of 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_config(path: Path, port: int, backends: list[dict[str, Any]]) -> Path:
    path.write_text(
        yaml.safe_dump({"server": {"host": "127.0.0.1", "port": port}, "backends": backends})
    )
    return path


ONE_BACKEND = {"id": "a", "url": "http://127.0.0.1:9"}
"""A backend never asked (the commands under test stop before)."""


def sim_backend(name: str, port: int) -> dict[str, Any]:
    """A demo backend: a simulator of ``m1`` on ``port``."""
    return {"id": name, "url": f"http://127.0.0.1:{port}", "sim": {"model": "m1"}}


def in_use(port: int, hint: str = "pick --port") -> str:
    return (
        f"cannot listen on 127.0.0.1:{port}: address already in use "
        f"(another process listens there; {hint})"
    )


# ---- a server that cannot listen says where and why ----------------------------------------

DEMO_SIM_HINT = "stop it, or give the demo a --config whose backends' urls use free ports"


@pytest.mark.parametrize("command", ["serve", "demo", "demo-backend", "sim"])
def test_address_in_use_names_the_address_and_port(
    command: str, busy_port: int, tmp_path: Path
) -> None:
    """A busy port: one line on stderr naming the address, the reason and what to change,
    exit status 3; no traceback, no bare errno. ``demo``: the gateway's port is bound before
    any simulator starts; a simulator's busy port names that backend."""
    expected = f"llm-gateway: {in_use(busy_port)}"
    if command == "serve":
        cfg = write_config(tmp_path / "fleet.yaml", busy_port, [ONE_BACKEND])
        result = llm_gateway("serve", "--config", str(cfg), cwd=tmp_path)
    elif command == "demo":
        cfg = write_config(tmp_path / "fleet.yaml", busy_port, [sim_backend("s1", free_port())])
        result = llm_gateway("demo", "--config", str(cfg), cwd=tmp_path)
    elif command == "demo-backend":
        cfg = write_config(
            tmp_path / "fleet.yaml",
            free_port(),
            [sim_backend("s1", free_port()), sim_backend("s2", busy_port)],
        )
        result = llm_gateway("demo", "--config", str(cfg), cwd=tmp_path)
        expected = f"llm-gateway: simulated backend s2: {in_use(busy_port, DEMO_SIM_HINT)}"
    else:
        result = llm_gateway("sim", "--port", str(busy_port), cwd=tmp_path)
    lines = result.stderr.splitlines()
    said = [line for line in lines if "listen" in line or "in use" in line.lower()]
    assert said == [expected], result.stderr
    assert not [line for line in lines if "Traceback" in line or "Errno" in line], result.stderr
    assert result.returncode == 3, result.stderr


# ---- which config file a command reads -----------------------------------------------------


def test_commands_read_only_the_config_they_name(tmp_path: Path, busy_port: int) -> None:
    """Outside the repository, without ``--config`` or ``LLM_GATEWAY_CONFIG`` and with no
    ``./config/gateway.yaml`` or ``./gateway.yaml``: ``check-config`` and ``serve`` stop with
    one line saying what to pass (exit 2), instead of reading the repository's demo file.
    ``serve`` gets a busy ``--port``, so that reading some other file shows as a failure to
    listen, not as a gateway left running."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (("check-config",), ("serve", "--port", str(busy_port))):
        result = llm_gateway(*argv, cwd=empty)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert result.stdout == ""
        (line,) = result.stderr.splitlines()
        assert line.startswith("llm-gateway: no config file: pass --config PATH or set "
                               "LLM_GATEWAY_CONFIG=PATH"), line


@pytest.mark.parametrize("how", ["--config", "LLM_GATEWAY_CONFIG", "./config/gateway.yaml",
                                 "./gateway.yaml"])
def test_commands_say_which_config_file_they_read(how: str, tmp_path: Path) -> None:
    """Every way of naming or finding the file: ``check-config`` says ``config: <absolute
    path>`` first, and reads that file (its one backend); ``--config`` wins over the
    variable, the variable over the current directory, ``./config/gateway.yaml`` over
    ``./gateway.yaml``."""
    work = tmp_path / "work"
    (work / "config").mkdir(parents=True)
    decoy = [{"id": "decoy", "url": "http://127.0.0.1:9"}]
    chosen = {  # highest precedence first
        "--config": tmp_path / "mine.yaml",
        "LLM_GATEWAY_CONFIG": tmp_path / "env.yaml",
        "./config/gateway.yaml": work / "config" / "gateway.yaml",
        "./gateway.yaml": work / "gateway.yaml",
    }
    order = list(chosen)
    for name, path in chosen.items():  # the ways below the chosen one exist, as decoys
        backends = [{"id": "chosen", "url": "http://127.0.0.1:9"}] if name == how else decoy
        if order.index(name) >= order.index(how):
            write_config(path, 8000, backends)
    argv = ["check-config"]
    if how == "--config":
        argv += ["--config", os.path.relpath(chosen[how], work)]
    env = {"LLM_GATEWAY_CONFIG": str(chosen["LLM_GATEWAY_CONFIG"])}
    if how in ("./gateway.yaml", "./config/gateway.yaml"):
        env = {}
    result = llm_gateway(*argv, cwd=work, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"config: {chosen[how].resolve()}", result.stdout
    assert lines[1] == "ok: 1 backend, listening on 127.0.0.1:8000", result.stdout
    assert lines[2].split()[0] == "chosen", result.stdout


def test_serve_and_demo_say_which_config_file_they_read(tmp_path: Path, busy_port: int) -> None:
    """``serve --config`` names the file it read on stderr; ``demo`` without a file runs its
    built-in fleet and says so (a busy ``--port`` ends both at once: nothing starts)."""
    cfg = write_config(tmp_path / "fleet.yaml", busy_port, [ONE_BACKEND])
    result = llm_gateway("serve", "-c", "fleet.yaml", cwd=tmp_path)
    assert result.stderr.splitlines()[0] == f"config: {cfg.resolve()}", result.stderr
    result = llm_gateway("demo", "--port", str(busy_port), cwd=tmp_path)
    builtin = (REPO / "gateway" / "demo_fleet.yaml").resolve()
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"config: {builtin} (built-in demo fleet"), result.stderr
    assert result.returncode == 3, result.stderr


def test_demo_builtin_fleet_is_the_repository_demo_config() -> None:
    """The demo's built-in fleet ships in the package (package data) and is the text of
    ``config/gateway.yaml``, so the README's demo reads the same fleet wherever it runs."""
    builtin = REPO / "gateway" / "demo_fleet.yaml"
    assert builtin.read_text() == (REPO / "config" / "gateway.yaml").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "demo_fleet.yaml" in pyproject["tool"]["setuptools"]["package-data"]["gateway"]


# ---- a refusal is counted under a served model ---------------------------------------------


def counted(url: str) -> dict[tuple[str, str, str], float]:
    """``gateway_requests_total`` as ``{(endpoint, model, status): count}``, summed over
    ``version`` (with the ``gateway_request_duration_seconds`` count under
    ``(endpoint, model, "duration")``)."""
    out: dict[tuple[str, str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "gateway_requests_total":
                key = (s.labels["endpoint"], s.labels["model"], s.labels["status"])
                out[key] = out.get(key, 0.0) + s.value
            elif s.name == "gateway_request_duration_seconds_count":
                out[(s.labels["endpoint"], s.labels["model"], "duration")] = s.value
    return out


REFUSED = [
    ("/v1/chat/completions", {"model": "m1"}),
    ("/v1/chat/completions", {"model": "m1", "messages": [], "stream": "yes"}),
    ("/v1/completions", {"model": "m1"}),
    ("/v1/embeddings", {"model": "m1"}),
    ("/v1/responses", {"model": "m1", "input": "hi", "stream": 1}),
    ("/tokenize", {"model": "m1", "prompt": "hi", "stream": "no"}),
]


@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
@pytest.mark.parametrize(("endpoint", "body"), REFUSED,
                         ids=[f"{e}-{'-'.join(b)}" for e, b in REFUSED])
def test_gateway_refusal_counted_under_served_model(
    backends, gateway, endpoint: str, body: dict[str, Any], batcher: bool
) -> None:
    """A body whose ``model`` a backend serves, refused 400 by the gateway (a required field
    missing, ``stream`` not a boolean): counted under that model in
    ``gateway_requests_total`` and the latency histogram, on every model route. A model no
    backend serves stays "" (an arbitrary client string is no label value): its 404, and a
    400 for its body."""
    gw = gateway({"a": backends()}, batcher={"enabled": batcher})
    r = httpx.post(gw.url + endpoint, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    unknown = {**body, "model": "no-such-model"}
    assert httpx.post(gw.url + endpoint, json=unknown, timeout=10).status_code == 400
    complete = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
    r = httpx.post(gw.url + endpoint, json={**complete, "model": "no-such-model"}, timeout=10)
    assert r.status_code == 404, r.text
    seen = counted(gw.url)
    assert seen.get((endpoint, "m1", "400")) == 1, seen
    assert seen.get((endpoint, "m1", "duration")) == 1, seen
    assert seen.get((endpoint, "", "400")) == 1, seen
    assert seen.get((endpoint, "", "404")) == 1, seen
    assert not [k for k in seen if k[1] == "no-such-model"], seen
