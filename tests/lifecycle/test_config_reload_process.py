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

import json
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
        r = httpx.post(gw.url + "/admin/config", content=yaml.safe_dump(running), timeout=10,
                       headers={"content-type": "application/yaml"})
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


def kept_holds(url: str) -> tuple[int, dict[str, Any]]:
    """The running version and the holds kept with it."""
    data = httpx.get(url + "/admin/config/history?config=true", timeout=5).json()["data"][0]
    return data["version"], data["state"]["holds"]


def post_view_back(url: str, max_num_seqs: int) -> httpx.Response:
    """``GET /admin/config``'s body, backend a's ``max_num_seqs`` changed (a live field),
    posted back whole."""
    view = httpx.get(url + "/admin/config", timeout=5).json()
    view["config"]["backends"][0]["max_num_seqs"] = max_num_seqs
    return httpx.post(url + "/admin/config", json=view, timeout=10)


def test_a_start_says_whether_it_resumed_and_a_kept_config_no_longer_valid_is_skipped(
        sims, tmp_path):
    a, b = sims("A"), sims("B")
    port = free_port()
    state = tmp_path / "state"
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "graceful_shutdown_s": 1},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "lifecycle": {"warmup_batch_shapes": [], "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "reload": {"state_dir": str(state), "checkpoint_s": 0.2},
        "backends": [{"id": "a", "url": a.url}, {"id": "b", "url": b.url}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "gateway.log"
    gw = ServeProcess(path, port, log, tmp_path)
    try:
        gw.wait_ready()
        assert "config: starting from the config file: no config version kept" in log.read_text()
        assert httpx.post(gw.url + "/admin/backends/b/drain", json={"deadline_s": 1},
                          timeout=5).status_code == 202
        r = post_view_back(gw.url, 7)
        assert r.status_code == 200 and r.json()["version"] == 2, r.text
        assert wait_for(lambda: kept_holds(gw.url) == (2, {"b": "admin_drain"}), 10)
        gw.stop()
        # ---- the file edited (a comment): the start says it does not resume version 2, why,
        # and that the state it takes up was kept with version 2 ---------------------------
        path.write_text("# edited\n" + path.read_text())
        gw = ServeProcess(path, port, log, tmp_path)
        gw.wait_ready()
        assert history(gw.url)[0] == (3, "start")
        text = log.read_text()
        assert ("config: starting from the config file, not resuming version 2 (admin): the "
                "config file, the LLM_GATEWAY_* environment or the command line changed "
                "since version 2 was applied") in text
        assert wait_for(lambda: "restored the state kept with version 2, carried to version 3"
                        in log.read_text(), 10), log.read_text()[-2000:]
        assert "version 3's kept state" not in log.read_text()
        r = post_view_back(gw.url, 9)
        assert r.status_code == 200 and r.json()["version"] == 4, r.text
        gw.stop()
        # ---- version 4's kept config no longer valid (a field an upgrade removed): the start
        # goes on from the file and says why it did not resume ------------------------------
        snap_file = state / "config-history" / "00000004.json"
        snap = json.loads(snap_file.read_text())
        snap["config"]["lifecycle"]["old_renamed_field"] = 1
        snap_file.write_text(json.dumps(snap))
        gw = ServeProcess(path, port, log, tmp_path)
        gw.wait_ready()
        assert backend_ids(gw.url) == {"a", "b"}
        assert history(gw.url)[0] == (5, "start")
        running = httpx.get(gw.url + "/admin/config", timeout=5).json()["config"]
        assert running["backends"][0]["max_num_seqs"] != 9  # the file's, not version 4's
        line = next(x for x in log.read_text().splitlines() if "not resuming version 4" in x)
        assert "warning" in line and str(snap_file) in line
        assert "lifecycle.old_renamed_field" in line
        assert gw.proc.poll() is None
    finally:
        gw.stop()
