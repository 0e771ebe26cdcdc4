"""The DNS source alone against a real DNS server (dnsmasq): what each answer reports to
the sink (the whole set; an IPv6 address bracketed; NXDOMAIN acted on only once confirmed;
a resolver that does not answer is an outage)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from gateway.config import DnsDiscoveryConfig
from gateway.fleet.discovery import Endpoint, NodeInfo, SpotNotice
from gateway.fleet.dns_source import EMPTY_CONFIRMATIONS, DnsSource, nameserver_of
from tests.support.dnsmasq import DnsServer


class Recorder:
    """A sink that keeps what it was told, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def endpoints(self, snapshot: Sequence[Endpoint]) -> None:
        self.calls.append(("endpoints", list(snapshot)))

    def outage(self, reason: str) -> None:
        self.calls.append(("outage", reason))

    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        self.calls.append(("nodes", dict(nodes)))

    def spot_notice(self, notice: SpotNotice) -> None:
        self.calls.append(("spot", notice))


def source(server: DnsServer, name: str = "vllm.test") -> DnsSource:
    return DnsSource(DnsDiscoveryConfig(
        name=name, port=8000, interval_s=0.1, timeout_s=0.5, nameservers=[server.nameserver]
    ))


async def test_addresses_become_endpoints_ipv6_bracketed(dns_server: DnsServer) -> None:
    dns_server.set_records([("127.0.0.9", "vllm.test"), ("::1", "vllm.test"),
                            ("127.0.0.7", "other.test")])
    sink = Recorder()
    await source(dns_server).round(sink)
    [(kind, snapshot)] = sink.calls
    assert kind == "endpoints"
    assert [(e.id, e.url, e.host) for e in snapshot] == [  # type: ignore[attr-defined]
        ("127.0.0.9-8000", "http://127.0.0.9:8000", "127.0.0.9"),
        ("::1-8000", "http://[::1]:8000", "::1"),
    ]


async def test_nxdomain_empties_the_fleet_only_once_confirmed(dns_server: DnsServer) -> None:
    dns_server.set_records([("127.0.0.9", "vllm.test")])
    src, sink = source(dns_server), Recorder()
    await src.round(sink)
    dns_server.set_records([])
    for _ in range(EMPTY_CONFIRMATIONS - 1):
        await src.round(sink)
    assert [k for k, _ in sink.calls] == ["endpoints"]  # one NXDOMAIN: nothing acted on
    await src.round(sink)
    assert sink.calls[-1] == ("endpoints", [])


async def test_a_resolver_that_does_not_answer_is_an_outage(dns_server: DnsServer) -> None:
    src, sink = source(dns_server), Recorder()
    dns_server.stop()
    await src.round(sink)
    [(kind, reason)] = sink.calls
    assert kind == "outage" and "vllm.test" in str(reason)


def test_nameserver_entries() -> None:
    assert (nameserver_of("10.0.0.10").address, nameserver_of("10.0.0.10").port) == (
        "10.0.0.10", 53
    )
    ns = nameserver_of("127.0.0.1:5353")
    assert (ns.address, ns.port) == ("127.0.0.1", 5353)
    ns = nameserver_of("[fd00::a]:5353")
    assert (ns.address, ns.port) == ("fd00::a", 5353)
    assert nameserver_of("fd00::a").port == 53
    with pytest.raises(ValueError):
        nameserver_of("host:dns")
