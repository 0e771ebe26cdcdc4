"""A non-loopback IPv4 address of the test host, for tests that must reach the gateway as a
remote client would (issue 20: the admin API answers loopback clients only without a key).

Connecting to one of the host's own non-loopback addresses from a socket bound to it makes
the kernel use that address as the source, so the gateway (listening on ``0.0.0.0``) sees
a non-loopback client without root and without a second machine. When the host has none,
a root test run adds one to the loopback interface (``ip addr add 10.254.0.7/32 dev lo``)
for the module and removes it after.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
from collections.abc import Iterator

SPARE = "10.254.0.7"
"""The address added to ``lo`` when the host has no other (RFC 1918, unlikely in use)."""


def _is_remote(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def own_address() -> str | None:
    """A non-loopback IPv4 address of this host, or None: the source the kernel picks
    toward an outside destination (a UDP ``connect`` sends nothing), else the first
    global address ``ip -j -4 addr`` lists."""
    for probe in ("192.0.2.1", "10.255.255.255", "198.51.100.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if _is_remote(addr):
            return str(addr)
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True,
                             timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for link in json.loads(out or "[]"):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet" and _is_remote(a.get("local", "127.0.0.1")):
                return str(a["local"])
    return None


@contextlib.contextmanager
def non_loopback_address() -> Iterator[str | None]:
    """A non-loopback address of this host for the duration (module docstring); None when
    there is none and none can be added (not root, or no ``ip``)."""
    addr = own_address()
    if addr is not None:
        yield addr
        return
    if os.geteuid() != 0:
        yield None
        return
    try:
        subprocess.run(["ip", "addr", "add", f"{SPARE}/32", "dev", "lo"], check=True,
                       capture_output=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        yield None
        return
    try:
        yield SPARE
    finally:
        subprocess.run(["ip", "addr", "del", f"{SPARE}/32", "dev", "lo"],
                       capture_output=True, timeout=5)
