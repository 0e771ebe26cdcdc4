"""The DNS source alone against a real DNS server (dnsmasq): what each answer reports to
the sink (the whole set; an IPv6 address bracketed; NXDOMAIN acted on only once confirmed;
a resolver that does not answer is an outage)."""

from __future__ import annotations

import pytest

from gateway.config import DnsDiscoveryConfig
from gateway.fleet.dns_source import EMPTY_CONFIRMATIONS, DnsSource, nameserver_of
from tests.discovery.kube_support import RecordingSink
from tests.support.dnsmasq import DnsServer


def source(server: DnsServer, name: str = "vllm.test") -> DnsSource:
    return DnsSource(DnsDiscoveryConfig(
        name=name, port=8000, interval_s=0.1, timeout_s=0.5, nameservers=[server.nameserver]
    ))


async def test_addresses_become_endpoints_ipv6_bracketed(dns_server: DnsServer) -> None:
    dns_server.set_records([("127.0.0.9", "vllm.test"), ("::1", "vllm.test"),
                            ("127.0.0.7", "other.test")])
    sink = RecordingSink()
    await source(dns_server).round(sink)
    [(kind, snapshot)] = sink.calls
    assert kind == "endpoints"
    assert [(e.id, e.url, e.host) for e in snapshot] == [  # type: ignore[attr-defined]
        ("127.0.0.9-8000", "http://127.0.0.9:8000", "127.0.0.9"),
        ("::1-8000", "http://[::1]:8000", "::1"),
    ]


async def test_nxdomain_empties_the_fleet_only_once_confirmed(dns_server: DnsServer) -> None:
    dns_server.set_records([("127.0.0.9", "vllm.test")])
    src, sink = source(dns_server), RecordingSink()
    await src.round(sink)
    dns_server.set_records([])
    for _ in range(EMPTY_CONFIRMATIONS - 1):
        await src.round(sink)
    assert [k for k, _ in sink.calls] == ["endpoints"]  # one NXDOMAIN: nothing acted on
    await src.round(sink)
    assert sink.calls[-1] == ("endpoints", [])


async def test_a_resolver_that_does_not_answer_is_an_outage(dns_server: DnsServer) -> None:
    src, sink = source(dns_server), RecordingSink()
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
