"""Backend discovery: one interface, three sources (``discovery.source`` in the config).

* ``static``: the ``backends:`` list, as always (:class:`StaticSource`: one snapshot, then
  nothing changes);
* ``dns``: a headless Service's A/AAAA records, re-resolved on an interval
  (:mod:`gateway.fleet.dns_source`);
* ``kubernetes``: a list + watch of EndpointSlices by label selector, and of nodes for
  placement labels and spot interruption notices (:mod:`gateway.fleet.kube_source`).

A source reports to a :class:`DiscoverySink` (the gateway's :mod:`gateway.fleet.membership`,
which alone adds backends to and removes them from the :class:`~gateway.fleet.fleet.Fleet`):
always the **whole** current set of endpoints (:meth:`DiscoverySink.endpoints`), never a
delta, so a missed event or a reconnect cannot leave the fleet wrong; an outage of the source
(:meth:`DiscoverySink.outage`), during which the last known fleet is kept as it is; what it
knows about nodes; and spot interruption notices.

Endpoint conditions follow Kubernetes' EndpointSlice API (``discovery.k8s.io/v1``,
`EndpointConditions <https://kubernetes.io/docs/concepts/services-networking/endpoint-slices/#conditions>`_):
``ready`` (serving and not terminating), ``serving`` (passes its readiness probe, even while
terminating), ``terminating``. A DNS record is ready and serving, never terminating.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Endpoint:
    """One backend as a discovery source sees it.

    ``id``: the backend id it gets (stable for the endpoint's life: the pod name for
    Kubernetes, ``host-port`` for DNS); ``url``: ``scheme://host:port``; ``host``: the
    address alone (for ``{host}`` in the template's ``gpu_metrics_url``). ``zone``, ``node``,
    ``pod``, ``namespace``: where it runs, when the source knows (EndpointSlice ``zone``,
    ``nodeName``, ``targetRef``)."""

    id: str
    url: str
    host: str
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    zone: str | None = None
    node: str | None = None
    pod: str | None = None
    namespace: str | None = None


@dataclass(frozen=True)
class NodeInfo:
    """What the node watch knows of one node: its zone (``topology.kubernetes.io/zone``),
    capacity type (``karpenter.sh/capacity-type``, ``eks.amazonaws.com/capacityType``,
    ``cloud.google.com/gke-spot`` / ``gke-preemptible``, ...: ``on-demand`` | ``spot`` | None
    when no label says) and instance type (``node.kubernetes.io/instance-type``)."""

    name: str
    zone: str | None = None
    capacity_type: str | None = None
    instance_type: str | None = None


@dataclass(frozen=True)
class SpotNotice:
    """A spot interruption notice: the provider will reclaim ``node`` (in ``zone``, of
    ``instance_type``, when known). ``reason``: what said so (a taint key, a node condition,
    ``admin``). ``capacity_type``: the node's, when its labels say (``on-demand`` | ``spot``;
    None: not said, as from the admin API). The handlers' taints also mark nodes that go for
    other reasons (Karpenter's ``karpenter.sh/disrupted`` for consolidation and drift, an
    ASG's scale-in): a notice for a node known to be ``on-demand`` is no evidence about the
    zone's spot capacity (:mod:`gateway.fleet.spot`)."""

    zone: str | None
    node: str | None = None
    instance_type: str | None = None
    reason: str = "admin"
    capacity_type: str | None = None


class DiscoverySink(Protocol):
    """Where a source reports. Every method is called from the event loop and returns at
    once (the sink does its I/O in its own tasks)."""

    def endpoints(self, snapshot: Sequence[Endpoint]) -> None:
        """The whole current set of endpoints of the source (ids unique)."""

    def outage(self, reason: str) -> None:
        """The source cannot be read (``reason``: one line); the last known fleet is kept.
        The next :meth:`endpoints` ends the outage."""

    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        """The whole current set of nodes by name (Kubernetes only)."""

    def spot_notice(self, notice: SpotNotice) -> None:
        """A node is about to be reclaimed (Kubernetes only; once per node and notice)."""


class DiscoverySource(Protocol):
    """A source of endpoints. ``name``: ``static`` | ``dns`` | ``kubernetes``."""

    name: str

    async def run(self, sink: DiscoverySink) -> None:
        """Report to ``sink`` until cancelled. Never raises but ``CancelledError``: a
        failure is reported as :meth:`DiscoverySink.outage` and retried."""


class StaticSource:
    """The ``backends:`` list: nothing to report (the fleet is built from it at start)."""

    name = "static"

    async def run(self, sink: DiscoverySink) -> None:
        """Returns at once: a static fleet never changes."""
        return None


__all__ = [
    "DiscoverySink",
    "DiscoverySource",
    "Endpoint",
    "NodeInfo",
    "SpotNotice",
    "StaticSource",
]
