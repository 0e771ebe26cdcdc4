"""Live reload of the gateway process (issue 18): ``llm-gateway serve -c <yaml>`` as a real
subprocess in front of simulated vLLM servers, ``reload.state_dir`` set.

``POST /admin/config`` adds a backend; the process is stopped and started again with the
same (unchanged) file: it resumes from the last applied config (the added backend is there,
the history goes on). Then the file is edited and the process gets ``SIGHUP``: the edited
file is applied (``source: sighup``); an edit that is not a valid config is refused by
``SIGHUP`` and changes nothing. The gateway runs with ``--port``, which beats the file's
``server.port`` at start and on every reload (a reload never refuses the port the command
line set).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.gateway_process import ServeProcess
from tests.support.scripted import wait_for
from tests.support.vllm import free_port


def backend_ids(url: str) -> set[str]:
    return {b["id"] for b in httpx.get(url + "/admin/backends", timeout=5).json()["backends"]}


def history(url: str) -> list[tuple[int, str]]:
    data = httpx.get(url + "/admin/config/history", timeout=5).json()["data"]
    return [(h["version"], h["source"]) for h in data]


def test_restart_resumes_the_last_applied_config_and_sighup_reads_the_file(sims, tmp_path):
    a, b, c = sims("A"), sims("B"), sims("C")
    port = free_port()
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": free_port(), "graceful_shutdown_s": 1},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "lifecycle": {"warmup_batch_shapes": [], "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "reload": {"state_dir": str(tmp_path / "state")},
        "backends": [{"id": "a", "url": a.url}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "gateway.log"
    args = ("--port", str(port))
    gw = ServeProcess(path, port, log, tmp_path, args)
    try:
        gw.wait_ready()
        running = httpx.get(gw.url + "/admin/config", timeout=5).json()["config"]
        running["backends"].append({"id": "b", "url": b.url})
        r = httpx.post(gw.url + "/admin/config", content=yaml.safe_dump(running), timeout=10)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: backend_ids(gw.url) == {"a", "b"}, 10)
        gw.stop()
        # ---- the same file: the restart resumes version 2 ---------------------------------
        gw = ServeProcess(path, port, log, tmp_path, args)
        gw.wait_ready()
        assert backend_ids(gw.url) == {"a", "b"}
        assert history(gw.url) == [(2, "admin"), (1, "start")]
        assert "resuming version 2 (admin)" in log.read_text()
        # ---- SIGHUP: the edited file is applied; then a broken edit changes nothing -------
        cfg["backends"] = [{"id": "a", "url": a.url}, {"id": "c", "url": c.url}]
        path.write_text(yaml.safe_dump(cfg))
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: backend_ids(gw.url) == {"a", "c"}, 20), backend_ids(gw.url)
        assert history(gw.url)[0] == (3, "sighup")
        path.write_text(Path(path).read_text() + "proxy: {idle_timeout_s: -1}\n")
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "SIGHUP: config not applied" in log.read_text(), 10)
        assert "proxy.idle_timeout_s" in log.read_text()
        assert history(gw.url)[0] == (3, "sighup")
        assert backend_ids(gw.url) == {"a", "c"}
        assert gw.proc.poll() is None  # still serving
        gw.stop()
        # ---- the file as version 3 read it, without --port: not the start kept, the file's
        # port (the command line is part of what a restart resumes from) -------------------
        path.write_text(yaml.safe_dump(cfg))
        gw.proc.wait(10)
        gw = ServeProcess(path, cfg["server"]["port"], log, tmp_path)
        gw.wait_ready()
        assert backend_ids(gw.url) == {"a", "c"}
        assert history(gw.url)[0] == (4, "start")
    finally:
        gw.stop()
