"""Ending the subprocesses tests start (servers: prometheus, dnsmasq, a gateway)."""

from __future__ import annotations

import subprocess


def end_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace_s: float
                ) -> None:
    """SIGTERM ``proc`` if it still runs, wait up to ``grace_s`` seconds, then SIGKILL it
    and wait up to 5 s more."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
