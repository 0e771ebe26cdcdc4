"""``llm-gateway serve -c <yaml>`` as a real subprocess (the tests of the process itself:
signals, graceful shutdown, restarts). Its output goes to a log file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

CLI = Path(sys.executable).with_name("llm-gateway")


class ServeProcess:
    """``llm-gateway serve -c path`` (and ``args``) started now, listening on ``port`` (the
    config's, or the one ``args`` give), logging to ``log`` (appended: a restart's log
    follows the first's), run in ``cwd``."""

    def __init__(self, path: Path, port: int, log: Path, cwd: Path,
                 args: tuple[str, ...] = ()) -> None:
        self.path = path
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cli = [str(CLI)] if CLI.exists() else [sys.executable, "-m", "gateway.cli"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([*cli, "serve", "-c", str(path), *args], stdout=out,
                                         stderr=subprocess.STDOUT, cwd=cwd)

    def wait_ready(self, timeout: float = 30) -> None:
        """Until ``/ready`` and ``/ready/fleet`` answer 200 (a backend routable)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if (httpx.get(self.url + "/ready", timeout=1).status_code == 200
                        and httpx.get(self.url + "/ready/fleet", timeout=1).status_code == 200):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("gateway not ready: " + self.log.read_text()[-2000:])

    def stop(self) -> None:
        """SIGKILL, if still running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
