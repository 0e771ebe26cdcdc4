"""Child processes of a benchmark (simulators, gateways): started with their output in a log
file, stopped with SIGTERM then SIGKILL; and a free loopback port."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """The processes a benchmark started; ``stop_all()`` in a ``finally``."""

    def __init__(self, logdir: Path, cwd: Path | None = None) -> None:
        self.logdir = logdir
        self.cwd = cwd
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        """Start ``cmd``, its stdout and stderr in ``logdir/name.log``."""
        log = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd
        )
        log.close()
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds."""
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        for p in list(self.procs):
            self.stop(p)
