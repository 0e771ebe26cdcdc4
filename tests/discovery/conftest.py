"""Fixtures of the discovery tests: a real DNS server (dnsmasq) and simulated vLLM servers
on distinct loopback addresses sharing one port (as the pods of a headless Service do)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.lifecycle.support import Sim
from tests.support.dnsmasq import DnsServer


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    """A started dnsmasq answering from a hosts file the test rewrites."""
    server = DnsServer().start()
    yield server
    server.close()


@pytest.fixture
def pods() -> Iterator[Callable[..., Sim]]:
    """Factory ``pods(address, **Sim options)``: a simulated vLLM on ``address`` (e.g.
    ``127.0.0.2``), every one on the port the first one got."""
    made: list[Sim] = []

    def make(address: str, itl_s: float = 0.01, **config: Any) -> Sim:
        port = made[0].port if made else 0
        s = Sim(address, itl_s, host=address, port=port, **config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
