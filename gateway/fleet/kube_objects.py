"""Pure: what Kubernetes objects mean to the gateway (no I/O; the objects come in as the API's
JSON, camelCase dicts, from :mod:`gateway.fleet.kube_source`).

* :func:`slice_endpoints` / :func:`merge_slices`: EndpointSlices (``discovery.k8s.io/v1``)
  -> :class:`~gateway.fleet.discovery.Endpoint` s;
* :func:`node_info`: a Node's labels -> :class:`~gateway.fleet.discovery.NodeInfo`;
* :func:`notice_reasons`: a Node's taints and conditions -> the spot interruption notices
  on it (each a reason string: the taint key or ``condition:<type>``).

The label and taint tables are data (below), each entry with its source.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.core.listening import host_port
from gateway.fleet.discovery import Endpoint, NodeInfo

Obj = Mapping[str, Any]
"""A Kubernetes object as the API serves it (JSON, camelCase keys)."""

# ---- Node labels ----------------------------------------------------------------------------

ZONE_LABELS: tuple[str, ...] = (
    # Well-known labels (kubernetes.io/docs/reference/labels-annotations-taints/): the GA
    # key first, then the one deprecated since 1.17 that older clusters still set.
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/zone",
)
INSTANCE_TYPE_LABELS: tuple[str, ...] = (
    # Well-known labels: set by the kubelet from the cloud provider; the beta key before 1.17.
    "node.kubernetes.io/instance-type",
    "beta.kubernetes.io/instance-type",
)

CAPACITY_TYPE_LABELS: tuple[tuple[str, Mapping[str, str]], ...] = (
    # Karpenter (sigs.k8s.io/karpenter pkg/apis/v1 CapacityTypeLabelKey): spot | on-demand |
    # reserved (capacity reservations: not reclaimed, so on-demand here).
    ("karpenter.sh/capacity-type", {"spot": "spot", "on-demand": "on-demand",
                                    "reserved": "on-demand"}),
    # EKS managed node groups: SPOT | ON_DEMAND | CAPACITY_BLOCK (EC2 Capacity Blocks for ML:
    # reserved for their term, not reclaimed as spot is).
    ("eks.amazonaws.com/capacityType", {"SPOT": "spot", "ON_DEMAND": "on-demand",
                                        "CAPACITY_BLOCK": "on-demand"}),
    # GKE Spot VMs and (legacy) preemptible VMs: "true" on such nodes.
    ("cloud.google.com/gke-spot", {"true": "spot"}),
    ("cloud.google.com/gke-preemptible", {"true": "spot"}),
    # AKS node pools: spot | regular (learn.microsoft.com/azure/aks/spot-node-pool).
    ("kubernetes.azure.com/scalesetpriority", {"spot": "spot", "regular": "on-demand"}),
)
"""(label key, {label value: capacity type}); the first label present with a known value
wins."""

# ---- Spot interruption notices --------------------------------------------------------------

NOTICE_TAINTS: tuple[tuple[str, str | None], ...] = (
    # aws-node-termination-handler (pkg/node/node.go; its README "taintNode"): the Spot
    # interruption notice (2 minutes' warning), the EC2 rebalance recommendation (an
    # elevated risk of interruption, usually 10-20 minutes before), and the ASG lifecycle
    # hook's termination (scale-in or AZ rebalance).
    ("aws-node-termination-handler/spot-itn", None),
    ("aws-node-termination-handler/rebalance-recommendation", None),
    ("aws-node-termination-handler/asg-lifecycle-termination", None),
    # Karpenter v1 (sigs.k8s.io/karpenter pkg/apis/v1 taints.go DisruptedTaintKey): the node
    # is being disrupted (interruption, consolidation, drift, expiry); NoSchedule.
    ("karpenter.sh/disrupted", None),
    # Karpenter before v1 (pkg/apis/v1beta1 taints.go): key karpenter.sh/disruption, value
    # "disrupting" (DisruptingNoScheduleTaintValue).
    ("karpenter.sh/disruption", "disrupting"),
    # GKE: the node termination handler (GoogleCloudPlatform/k8s-node-termination-handler,
    # and GKE's own graceful handling of Spot / preemptible VMs) taints a node being
    # preempted with cloud.google.com/impending-node-termination.
    ("cloud.google.com/impending-node-termination", None),
)
"""(taint key, required value or None for any): a node carrying one is about to be
reclaimed."""

NOTICE_CONDITIONS: tuple[tuple[str, str | None], ...] = (
    # OpenShift's machine-api termination handlers (openshift/cluster-api-provider-aws,
    # -gcp, -azure pkg/termination): node condition Terminating=True, reason
    # TerminationRequested, when the cloud announces the instance's termination.
    ("Terminating", "TerminationRequested"),
)
"""(node condition type, required reason or None for any), with status "True"."""


# ---- EndpointSlices -------------------------------------------------------------------------


def _slice_port(ports: Sequence[Obj] | None, port_name: str | None) -> int | None:
    """The slice's port named ``port_name`` (None: its first port), or None when it has
    none (a slice without ports means "not restricted": nothing the gateway can dial)."""
    for p in ports or ():
        if p.get("port") is None:
            continue
        if port_name is None or p.get("name") == port_name:
            return int(p["port"])
    return None


def slice_endpoints(slice_: Obj, port_name: str | None, scheme: str) -> list[Endpoint]:
    """The endpoints of one EndpointSlice (the API's JSON), in its order.

    Id: the ``targetRef`` name when it is a Pod, else ``<address>-<port>``; url
    ``scheme://address:port`` with the port named ``port_name`` (None: the slice's first);
    the first address only (the API: "No semantics are defined for additional addresses
    beyond the first"). Conditions per the API's EndpointConditions: ``ready`` nil -> true,
    ``serving`` nil -> true, ``terminating`` nil -> false. A slice without that port gives
    none."""
    port = _slice_port(slice_.get("ports"), port_name)
    if port is None:
        return []
    namespace = (slice_.get("metadata") or {}).get("namespace")
    out: list[Endpoint] = []
    for ep in slice_.get("endpoints") or ():
        addresses = ep.get("addresses") or ()
        if not addresses:
            continue
        address = str(addresses[0])
        cond = ep.get("conditions") or {}
        ready = cond.get("ready")
        serving = cond.get("serving")
        terminating = cond.get("terminating")
        ref = ep.get("targetRef") or {}
        pod = ref.get("name") if ref.get("kind") == "Pod" else None
        plain = address.replace(":", "-")  # an IPv6 address: no colons in a backend id
        out.append(Endpoint(
            id=str(pod) if pod else f"{plain}-{port}",
            url=f"{scheme}://{host_port(address, port)}",
            host=address,
            ready=True if ready is None else bool(ready),
            serving=True if serving is None else bool(serving),
            terminating=False if terminating is None else bool(terminating),
            zone=ep.get("zone"),
            node=ep.get("nodeName"),
            pod=str(pod) if pod else None,
            namespace=(ref.get("namespace") or namespace) if pod else None,
        ))
    return out


def without_port(slices: Mapping[str, Obj], port_name: str | None) -> list[str]:
    """The names of the ``slices`` (by name) that have ports but none named ``port_name``
    (None: any port will do, so none), sorted: their endpoints are skipped."""
    if port_name is None:
        return []
    return sorted(
        name for name, s in slices.items()
        if s.get("ports") and _slice_port(s.get("ports"), port_name) is None
    )


def _rank(e: Endpoint) -> tuple[bool, bool, bool]:
    return (e.ready, e.serving, not e.terminating)


def merge_slices(
    slices: Mapping[str, Obj], port_name: str | None, scheme: str
) -> list[Endpoint]:
    """Every endpoint of ``slices`` (by slice name), ids unique, sorted by id.

    One endpoint can sit in two slices (the API: "clients must handle" duplicates, e.g.
    while the EndpointSlice controller moves it, or an IPv4 and an IPv6 slice of a
    dual-stack Service): the one in the best condition (ready, then serving, then not
    terminating) is kept, ties to the first slice by name."""
    best: dict[str, Endpoint] = {}
    for name in sorted(slices):
        for e in slice_endpoints(slices[name], port_name, scheme):
            kept = best.get(e.id)
            if kept is None or _rank(e) > _rank(kept):
                best[e.id] = e
    return [best[k] for k in sorted(best)]


# ---- Nodes ----------------------------------------------------------------------------------


def _first_label(labels: Mapping[str, str], keys: Iterable[str]) -> str | None:
    for k in keys:
        v = labels.get(k)
        if v:
            return v
    return None


def capacity_type(labels: Mapping[str, str]) -> str | None:
    """``spot`` | ``on-demand`` from the first of :data:`CAPACITY_TYPE_LABELS` present with
    a known value; None when no label says."""
    for key, values in CAPACITY_TYPE_LABELS:
        v = labels.get(key)
        if v is not None and v in values:
            return values[v]
    return None


def node_info(node: Obj) -> NodeInfo:
    """A Node (the API's JSON) -> :class:`NodeInfo` from its labels: zone
    (:data:`ZONE_LABELS`), capacity type (:func:`capacity_type`), instance type
    (:data:`INSTANCE_TYPE_LABELS`)."""
    meta = node.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    return NodeInfo(
        name=str(meta.get("name", "")),
        zone=_first_label(labels, ZONE_LABELS),
        capacity_type=capacity_type(labels),
        instance_type=_first_label(labels, INSTANCE_TYPE_LABELS),
    )


def notice_reasons(node: Obj) -> list[str]:
    """The spot interruption notices a Node (the API's JSON) carries, each once: the taint
    key of every :data:`NOTICE_TAINTS` match (value checked when the table gives one),
    then ``condition:<type>`` of every :data:`NOTICE_CONDITIONS` match (status "True",
    reason checked when given). Empty: no notice."""
    out: list[str] = []
    for taint in (node.get("spec") or {}).get("taints") or ():
        key, value = taint.get("key"), taint.get("value")
        for want_key, want_value in NOTICE_TAINTS:
            if key == want_key and (want_value is None or value == want_value):
                if key not in out:
                    out.append(key)
    for cond in (node.get("status") or {}).get("conditions") or ():
        ctype, status, reason = cond.get("type"), cond.get("status"), cond.get("reason")
        for want_type, want_reason in NOTICE_CONDITIONS:
            if ctype == want_type and status == "True" and (
                want_reason is None or reason == want_reason
            ):
                r = f"condition:{ctype}"
                if r not in out:
                    out.append(r)
    return out


__all__ = [
    "CAPACITY_TYPE_LABELS",
    "INSTANCE_TYPE_LABELS",
    "NOTICE_CONDITIONS",
    "NOTICE_TAINTS",
    "ZONE_LABELS",
    "Obj",
    "capacity_type",
    "merge_slices",
    "node_info",
    "notice_reasons",
    "slice_endpoints",
    "without_port",
]
