"""A real Redis server for the fleet-mode tests: ``redis-server`` on a free loopback port,
no persistence, stopped (or killed, or restarted on the same port) by the test.

``.ci/run`` installs the Debian package ``redis-server``. Where the binary is missing the
fleet tests skip saying so, except under CI (``CI`` set), where they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.vllm import free_port


def redis_binary() -> str | None:
    """The ``redis-server`` (or ``valkey-server``) on PATH, or None."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def require_redis() -> str:
    """The server binary; skips the test without one (fails under CI)."""
    exe = redis_binary()
    if exe is None:
        msg = "redis-server is not installed (apt-get install redis-server; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


class RedisServer:
    """One ``redis-server`` process on ``port`` (default: a free one). :attr:`url` is its
    ``redis://`` address. :meth:`stop` / :meth:`start` keep the port (a restarted server
    starts empty, as a Redis without persistence does); :meth:`pause` / :meth:`resume`
    freeze it with SIGSTOP / SIGCONT (a store that accepts connections and never answers)."""

    def __init__(self, port: int | None = None) -> None:
        self.exe = require_redis()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gw-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it accepts connections."""
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its port closes."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections open, nothing answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server (SIGCONT)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop it and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
