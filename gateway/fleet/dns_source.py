"""The DNS discovery source: a headless Service's A and AAAA records, re-resolved every
``discovery.dns.interval_s`` seconds with dnspython's asyncio resolver.

Each address is one backend: id ``host-port`` (characters outside the backend id pattern
``[A-Za-z0-9_.:-]`` replaced by ``_``), url ``scheme://host:port`` (an IPv6 address in
brackets). Every round reports the whole set (:meth:`DiscoverySink.endpoints`); a DNS
record is ready and serving and never terminating, so an address that leaves the answer is
drained and removed (:mod:`gateway.fleet.membership`).

What each answer means:

* addresses (A and/or AAAA): the fleet;
* a timeout, SERVFAIL / REFUSED from every nameserver, an unreachable resolver: an
  **outage** (:meth:`DiscoverySink.outage`): the last known fleet is kept;
* **NXDOMAIN, or no A and no AAAA record (NODATA)**: no endpoint. Kubernetes' cluster DNS
  (CoreDNS, kube-dns) answers NXDOMAIN for a headless Service with no ready endpoints (the
  DNS specification was changed to say so: kubernetes/dns#245), so NXDOMAIN cannot tell a
  Service scaled to zero from a mistyped name. It is taken as an empty fleet (a Service
  scaled to zero is drained and removed), but only once :data:`EMPTY_CONFIRMATIONS`
  answers in a row say so (CoreDNS has been seen answering a spurious NXDOMAIN for a
  headless Service under churn: coredns/coredns#1365, #6518; one such answer must not
  drain the whole fleet), and loudly: an ERROR log naming the name and the likely causes
  when it begins and every :data:`EMPTY_LOG_EVERY_S` seconds while it lasts, and
  ``gateway_discovery_endpoints{source="dns"} 0``.

``nameservers``: ``host`` or ``host:port`` entries (``[v6]:port`` for an IPv6 address with
a port); None: the system's resolver (``/etc/resolv.conf``). The name is queried as given
(no search list): give it in full, e.g. ``vllm.default.svc.cluster.local``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from gateway.config import DnsDiscoveryConfig, parse_nameserver
from gateway.core.listening import host_port
from gateway.fleet.discovery import DiscoverySink, Endpoint

log = logging.getLogger("gateway.discovery")

# Answers in a row saying "no endpoint" (NXDOMAIN or NODATA) before the fleet is emptied.
EMPTY_CONFIRMATIONS = 2
# Seconds between the ERROR logs while the name resolves to nothing.
EMPTY_LOG_EVERY_S = 60.0

_NOT_ID = re.compile(r"[^A-Za-z0-9_.:-]")


class DnsOutage(Exception):
    """The name could not be resolved (timeout, SERVFAIL, no nameserver reachable)."""


def endpoint_of(address: str, port: int, scheme: str) -> Endpoint:
    """The :class:`Endpoint` of one resolved ``address`` (IPv4 or IPv6 text) on ``port``."""
    return Endpoint(
        id=_NOT_ID.sub("_", f"{address}-{port}"),
        url=f"{scheme}://{host_port(address, port)}",
        host=address,
    )


def nameserver_of(entry: str) -> dns.nameserver.Do53Nameserver:
    """A ``nameservers`` entry (:func:`gateway.config.parse_nameserver`: ``host``,
    ``host:port``, an IPv6 address, ``[v6]:port``; checked at load). Raises ``ValueError``
    for one that is not an address with an optional port."""
    host, port = parse_nameserver(entry)
    return dns.nameserver.Do53Nameserver(host, port)


class DnsSource:
    """Discovery from ``cfg`` (``discovery.dns``): module docstring. ``clock``: monotonic
    seconds (when the empty-answer log is next due)."""

    name = "dns"

    def __init__(
        self, cfg: DnsDiscoveryConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        if cfg.nameservers:
            self.resolver = dns.asyncresolver.Resolver(configure=False)
            self.resolver.nameservers = [nameserver_of(n) for n in cfg.nameservers]
        else:
            self.resolver = dns.asyncresolver.Resolver()
        self.resolver.timeout = cfg.timeout_s
        self.resolver.lifetime = cfg.timeout_s
        self.resolver.cache = None
        self._empty_rounds = 0
        self._empty_logged_at: float | None = None

    async def run(self, sink: DiscoverySink) -> None:
        """Resolve every ``interval_s`` and report, until cancelled."""
        while True:
            await self.round(sink)
            await asyncio.sleep(self.cfg.interval_s)

    async def round(self, sink: DiscoverySink) -> None:
        """One resolution, reported to ``sink`` (an outage, the set, or nothing while an
        empty answer is not yet confirmed)."""
        try:
            endpoints, why_empty = await self.resolve()
        except DnsOutage as e:
            sink.outage(str(e))
            return
        if endpoints:
            if self._empty_rounds:
                log.warning("discovery dns %s: resolves again", self.cfg.name)
            self._empty_rounds, self._empty_logged_at = 0, None
            sink.endpoints(endpoints)
            return
        self._empty_rounds += 1
        now = self._clock()
        if self._empty_logged_at is None or now - self._empty_logged_at >= EMPTY_LOG_EVERY_S:
            self._empty_logged_at = now
            log.error(
                "discovery dns %s: %s: no endpoint (a headless Service with no ready "
                "endpoints answers so, and so does a mistyped name: check "
                "discovery.dns.name)%s",
                self.cfg.name,
                why_empty,
                "" if self._empty_rounds >= EMPTY_CONFIRMATIONS else "; not acted on until "
                "the next answer says so too",
            )
        if self._empty_rounds >= EMPTY_CONFIRMATIONS:
            sink.endpoints([])

    async def resolve(self) -> tuple[list[Endpoint], str]:
        """The endpoints the A and AAAA records name now (sorted by address), and when
        there are none, why (``NXDOMAIN`` / ``no A or AAAA record``). Raises
        :class:`DnsOutage` when either query fails otherwise."""
        a, aaaa = await asyncio.gather(self._query("A"), self._query("AAAA"))
        addresses = sorted({*a[0], *aaaa[0]})
        why = "NXDOMAIN" if a[1] and aaaa[1] else "no A or AAAA record"
        return [endpoint_of(x, self.cfg.port, self.cfg.scheme) for x in addresses], why

    async def _query(self, rdtype: str) -> tuple[list[str], bool]:
        """(addresses, NXDOMAIN) of one record type."""
        try:
            answer = await self.resolver.resolve(
                self.cfg.name, rdtype, raise_on_no_answer=False, search=False
            )
        except dns.resolver.NXDOMAIN:
            return [], True
        except dns.resolver.LifetimeTimeout as e:
            raise DnsOutage(f"{rdtype} {self.cfg.name}: timeout ({e})") from None
        except dns.resolver.NoNameservers as e:
            raise DnsOutage(f"{rdtype} {self.cfg.name}: no nameserver answered ({e})") from None
        except (dns.exception.DNSException, OSError) as e:
            raise DnsOutage(f"{rdtype} {self.cfg.name}: {type(e).__name__}: {e}") from None
        if answer.rrset is None:
            return [], False
        return [r.to_text() for r in answer.rrset], False
