"""A real Prometheus server for tests (Debian package ``prometheus``): a temp config that
scrapes given targets every second and loads given rule files, a temp TSDB, a free port;
queries through its HTTP API (``/api/v1/query``, ``/api/v1/rules``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.processes import end_process


def prometheus_binary() -> str:
    """The ``prometheus`` binary; a missing one fails the test under CI (env ``CI`` set),
    and skips it otherwise."""
    found = shutil.which("prometheus")
    if found is None:
        why = "no prometheus binary (Debian package prometheus; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus process scraping ``targets`` (``host:port``, job ``llm-gateway``)
    every ``interval_s`` and evaluating ``rule_files`` as often; ``url``: its base URL."""

    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path],
                 interval_s: float = 1.0) -> None:
        self.workdir = workdir
        every = f"{round(interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": every, "evaluation_interval": every,
                       "scrape_timeout": every},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "llm-gateway",
                                "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 20) -> None:
        """Until ``/-/ready`` answers 200 (raises with its log when it exits or times out)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.logs()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready: {self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> dict[str, Any]:
        """``/api/v1/query`` of ``expr`` now: the whole JSON answer (``status``,
        ``data.result`` or ``error``)."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        return r.json()  # type: ignore[no-any-return]

    def value(self, expr: str) -> float | None:
        """The first sample's value of ``expr`` now (None: no sample)."""
        result = self.query(expr).get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else None

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with its group's name."""
        data = httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]
        return [{**r, "group": g["name"]} for g in data["groups"] for r in g["rules"]]

    def stop(self) -> None:
        end_process(self.proc, 10)
        self.log.close()
