"""A real DNS server for the discovery tests: Debian's ``dnsmasq`` on a free loopback UDP
port, unprivileged, answering only from a hosts file the test rewrites.

It runs in the foreground (``--no-daemon``) with no upstream (``--no-resolv``), no
``/etc/hosts`` (``--no-hosts``), its records from ``--addn-hosts=<file>``, names under
``.test`` answered locally (``--local=/test/``: an unknown one is NXDOMAIN) and TTL 0.
:meth:`DnsServer.set_records` rewrites the file and sends SIGHUP, on which dnsmasq re-reads
it; :meth:`stop` / :meth:`start` take the server away and bring it back on the same port.

``.ci/run`` installs the Debian package ``dnsmasq``. Where the binary is missing these tests
skip saying so, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

import pytest

from tests.support.processes import end_process


def require_dnsmasq() -> str:
    """The ``dnsmasq`` binary; skips the test without one (fails under CI)."""
    exe = shutil.which("dnsmasq") or (
        "/usr/sbin/dnsmasq" if os.access("/usr/sbin/dnsmasq", os.X_OK) else None
    )
    if exe is None:
        msg = "dnsmasq is not installed (apt-get install dnsmasq; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DnsServer:
    """One ``dnsmasq`` on ``127.0.0.1:port`` (default: a free port). :attr:`nameserver` is
    its ``host:port`` for ``discovery.dns.nameservers``."""

    def __init__(self, port: int | None = None) -> None:
        self.exe = require_dnsmasq()
        self.port = port or free_udp_port()
        self.dir = Path(tempfile.mkdtemp(prefix="gw-dnsmasq-"))
        self.hosts = self.dir / "hosts"
        self.hosts.write_text("")
        self.proc: subprocess.Popen[bytes] | None = None
        self._names: set[str] = set()  # the names of the records last set
        self.problem = ""

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_records(self, records: Iterable[tuple[str, str]]) -> None:
        """Make the server answer exactly ``records`` ((address, name) pairs): the hosts
        file rewritten, then SIGHUP, and waited for until a query shows it."""
        records = list(records)
        self.hosts.write_text("".join(f"{addr} {name}\n" for addr, name in records))
        names = self._names | {n for _, n in records}  # a name removed too: until NXDOMAIN
        self._names = {n for _, n in records}
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)
            for name in names:
                want = sorted(a for a, n in records if n == name and ":" not in a)
                self._wait_answer(name, want)

    def _wait_answer(self, name: str, want: list[str], timeout: float = 10.0) -> None:
        import dns.nameserver
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", self.port)]
        r.lifetime = 0.2
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break  # it exited (e.g. the port was taken)
            try:
                ans = r.resolve(name, "A", raise_on_no_answer=False, search=False)
                got = sorted(x.to_text() for x in ans.rrset or ())
            except dns.resolver.NXDOMAIN:
                got = []
            except Exception:
                got = ["?"]
            if got == want:
                return
            time.sleep(0.05)
        raise TimeoutError(f"dnsmasq still answers {got} for {name}, not {want}")

    def start(self, timeout: float = 10.0) -> DnsServer:
        """Start the server and wait until it answers (another free port when the one
        picked was taken meanwhile; kept across :meth:`stop` / :meth:`start` otherwise)."""
        for _ in range(3):
            if self._start_once(timeout):
                return self
            self.port = free_udp_port()
        raise RuntimeError(f"dnsmasq did not start: {self.problem}")

    def _start_once(self, timeout: float) -> bool:
        with (self.dir / "log").open("ab") as log:
            self.proc = self._spawn(log)
        try:
            self._wait_answer("probe-that-does-not-exist.test", [], timeout)
        except TimeoutError as e:
            self.stop()
            err = (self.dir / "log").read_text(errors="replace")
            self.problem = f"{e}; dnsmasq said: {err.strip()[-500:]}"
            return False
        return True

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [self.exe, "--no-daemon", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--addn-hosts={self.hosts}", f"--port={self.port}",
             "--listen-address=127.0.0.1", "--bind-interfaces", "--pid-file=",
             f"--user={getpass.getuser()}", "--local=/test/", "--local-ttl=0",
             "--cache-size=0", "--log-facility=-"],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )

    def stop(self) -> None:
        """Stop the server (queries then time out: a resolver outage)."""
        if self.proc is not None:
            end_process(self.proc, 5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
