"""``server.log_format: json`` (issue 19, logs and traces): ``llm-gateway serve`` as a real
process in front of two scripted backends, the openai SDK as client; every line the
process writes parses as one JSON object, lines logged while serving a request carry its
request id and backend, and uvicorn's own lines (error and access loggers) are JSON too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.cli import declared_log_format
from tests.support.gateway_process import ServeProcess
from tests.support.scripted import (
    Conn,
    Received,
    completion_obj,
    default_script,
    wait_for,
)
from tests.support.vllm import free_port

ROOT = Path(__file__).resolve().parents[2]


class JsonServe(ServeProcess):
    """``llm-gateway serve -c path`` of this checkout (``python -c`` on ``gateway.cli``
    with the repository first on ``PYTHONPATH``, whatever the installed entry point)."""

    def __init__(self, path: Path, port: int, log: Path, cwd: Path) -> None:
        self.path, self.port, self.log = path, port, log
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from gateway.cli import main; "
                 "sys.exit(main())", "serve", "-c", str(path)],
                stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def test_every_line_is_json_with_the_request_id_and_backend_on_request_lines(backends,
                                                                            tmp_path):
    first = threading.Event()

    async def fails_once(req: Received, conn: Conn) -> None:
        if req.path.startswith("/v1/completions"):  # the client hangs up first
            await asyncio.sleep(30)
            return
        if req.path.startswith("/v1/chat"):
            if not first.is_set():
                first.set()
                await conn.send_json(500, {"error": {"message": "boom", "type": "x"}})
            else:
                await conn.send_json(200, completion_obj("ok"))
            return
        await default_script(req, conn)

    a, b = backends(fails_once), backends(fails_once)
    port = free_port()
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "graceful_shutdown_s": 1,
                   "log_format": "json", "access_log": True},
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "lifecycle": {"warmup_batch_shapes": [], "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "reload": {"state_dir": str(tmp_path / "state")},
        "backends": [{"id": "a", "url": a.url, "models": ["m1"]},
                     {"id": "b", "url": b.url, "models": ["m1"]}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "gateway.log"
    gw = JsonServe(path, port, log, tmp_path)
    try:
        gw.wait_ready()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0,
                               timeout=10)
        answer = client.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-request-id": "req-json-1"})
        assert answer.parse().choices[0].message.content == "ok"
        # a client that hangs up while the backend works: its request still gets a line
        with pytest.raises(httpx.TimeoutException):
            httpx.post(gw.url + "/v1/completions", timeout=1.0,
                       json={"model": "m1", "prompt": "hi", "max_tokens": 4},
                       headers={"x-request-id": "req-hangup"})
        assert wait_for(lambda: "req-hangup" in log.read_text(), timeout=10)
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(15) == 0
    finally:
        gw.stop()
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line, or this fails
    assert all(isinstance(r, dict) for r in records)
    for r in records:
        assert {"time", "level", "logger", "message"} <= r.keys(), r
        when = datetime.fromisoformat(r["time"])  # RFC 3339, UTC
        assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0, r
        assert abs((datetime.now(UTC) - when).total_seconds()) < 300
    # the CLI's own line and uvicorn's error logger
    assert any(r["logger"] == "gateway.cli" and r["message"].startswith("config: ")
               for r in records)
    assert any(r["logger"] == "uvicorn.error" and "Uvicorn running" in r["message"]
               for r in records)
    # lines of the request: the failed first attempt (gateway) and the access line
    mine = [r for r in records if r.get("request_id") == "req-json-1"]
    failed = [r for r in mine if r["logger"] == "gateway.flow.pipeline"
              and r["message"].startswith("attempt on")]
    assert len(failed) == 1 and failed[0]["level"] == "INFO"
    (access,) = [r for r in mine if r["logger"] == "uvicorn.access"]
    assert access["method"] == "POST" and access["path"] == "/v1/chat/completions"
    assert access["status"] == 200
    assert {failed[0]["backend"], access["backend"]} == {"a", "b"}  # retried elsewhere
    assert all("backend" in r for r in mine)
    # the client that hung up: its request line, status 499, with its id and backend
    (gone,) = [r for r in records if r.get("request_id") == "req-hangup"
               and r["logger"] == "uvicorn.access"]
    assert gone["status"] == 499 and gone["path"] == "/v1/completions", gone
    assert gone["method"] == "POST" and gone["backend"] in ("a", "b"), gone
    # lines outside any request carry neither
    assert all("request_id" not in r for r in records if r["logger"] == "uvicorn.error")


def test_a_config_error_at_start_is_a_json_line_too(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("server:\n  log_format: json\n  port: eighty\nbackends: []\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_GATEWAY_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())",
         "serve", "-c", str(path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 2, done.stderr  # a config error's status, as before
    records = [json.loads(line) for line in done.stderr.splitlines()]  # each line JSON
    assert records and all({"time", "level", "logger", "message"} <= r.keys()
                           for r in records), records
    (error,) = [r for r in records if r["level"] == "CRITICAL"]
    assert "server.port" in error["message"], error  # the field, named


@pytest.mark.parametrize("text, declared", [
    ("server:\n  log_format: json\nbackends: [\n  {id: a\n", "json"),  # broken after it
    ("server: {port: 1, log_format: json}\nx: [", "json"),
    ("backends:\n  - id: a\n    log_format: json\n", None),  # not server's
    (": : :\nserver:\n  log_format: json\n", None),  # broken before it: unknown
    ("server:\n  port: 80\n", None),
], ids=["after", "flow", "elsewhere", "before", "absent"])
def test_the_log_format_a_broken_config_asked_for(tmp_path, text: str, declared: str | None):
    """Invalid YAML is said in JSON when the file asked for JSON before the error."""
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    assert declared_log_format(path, environ={}) == declared
    assert declared_log_format(path, {"LLM_GATEWAY_SERVER__LOG_FORMAT": "json"}) == "json"
