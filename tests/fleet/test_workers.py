"""``llm-gateway serve --workers N`` as a real subprocess: N processes on one port, each a
fleet-mode replica of the same Redis; a worker that dies is replaced (under a new replica
id); SIGTERM stops them all and the command exits 0; without ``coordination.redis_url`` the
command is refused with one line and exit status 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import ConfigError
from gateway.workers import require_fleet_mode, worker_config
from tests.lifecycle.support import MODEL, sdk
from tests.support.scripted import wait_for
from tests.support.servers import gateway_config
from tests.support.vllm import free_port

CLI = Path(sys.executable).with_name("llm-gateway")


def serve(tmp: Path, backend_url: str, workers: int, coordination: dict[str, Any] | None
          ) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "graceful_shutdown_s": 2},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "lifecycle": {"warmup_batch_shapes": [1], "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "backends": [{"id": "a", "url": backend_url}],
    }
    if coordination is not None:
        cfg["coordination"] = coordination
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp / "gateway.log"
    cli = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "gateway.cli"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*cli, "serve", "-c", str(path), "--workers", str(workers)],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=tmp)
    return proc, f"http://127.0.0.1:{port}", log


def fleet_ids(url: str) -> list[str]:
    try:
        r = httpx.get(url + "/admin/fleet", timeout=2)
    except httpx.HTTPError:
        return []
    return [x["id"] for x in r.json()["replicas"]] if r.status_code == 200 else []


def children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return {int(x) for x in out.split()}


def test_two_workers_share_one_port_and_appear_in_admin_fleet(tmp_path, redis_server, sims):
    a = sims("A")
    proc, url, log = serve(tmp_path, a.url, 2, {"redis_url": redis_server.url,
                                                "replica_id": "gw", "sync_interval_s": 0.1})
    try:
        assert wait_for(lambda: fleet_ids(url) == ["gw-w1", "gw-w2"], 40), log.read_text()
        client = sdk(url)
        for _ in range(6):
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert out.choices[0].message.content
        view = httpx.get(url + "/admin/fleet").json()
        pids = {r["id"]: r["pid"] for r in view["replicas"]}
        assert len(set(pids.values())) == 2 and set(pids.values()) <= children(proc.pid)
        assert {r["listen"] for r in view["replicas"]} == {url.removeprefix("http://")}
        # a worker killed is replaced by a new process under a new replica id
        os.kill(pids["gw-w1"], signal.SIGKILL)
        assert wait_for(lambda: "gw-w1.1" in fleet_ids(url), 40), log.read_text()
        assert wait_for(lambda: fleet_ids(url) == ["gw-w1.1", "gw-w2"], 20), fleet_ids(url)
        assert proc.poll() is None
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].message.content
        workers = {r["pid"] for r in httpx.get(url + "/admin/fleet").json()["replicas"]}
        assert len(workers) == 2 and workers <= children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert not any(_is_running(p) for p in workers)  # each joined before the exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_without_redis_url_are_refused(tmp_path, workers):
    proc, _url, log = serve(tmp_path, "http://127.0.0.1:1", workers, None)
    assert proc.wait(30) == 2
    lines = [ln for ln in log.read_text().splitlines() if not ln.startswith("config: ")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llm-gateway: --workers {workers} needs fleet mode")
    assert "coordination.redis_url" in lines[0]


def test_worker_replica_ids_derive_from_the_configured_one():
    backends = [{"id": "a", "url": "http://127.0.0.1:1"}]
    cfg = gateway_config(backends, coordination={"redis_url": "redis://h/0", "replica_id": "gw"})
    assert worker_config(cfg, 1, 0).coordination.replica_id == "gw-w1"
    assert worker_config(cfg, 2, 0).coordination.replica_id == "gw-w2"
    assert worker_config(cfg, 1, 1).coordination.replica_id == "gw-w1.1"  # restarted
    assert worker_config(cfg, 1, 0).coordination.redis_url == "redis://h/0"
    unnamed = gateway_config(backends, coordination={"redis_url": "redis://h/0"})
    assert worker_config(unnamed, 3, 0).coordination.replica_id is None  # default: pid-based
    require_fleet_mode(unnamed, 4)
    require_fleet_mode(gateway_config(backends), 1)  # one worker: the embedded default
    with pytest.raises(ConfigError, match="--workers 2 needs fleet mode"):
        require_fleet_mode(gateway_config(backends), 2)
