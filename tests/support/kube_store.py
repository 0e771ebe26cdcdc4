"""The state of the Kubernetes API server DOUBLE (``tests/support/kube_api.py``), without
its HTTP: objects by collection, namespace and name, one resourceVersion counter (as etcd's
revision), the history of changes a watch replays (until :meth:`KubeStore.compact`), label
selectors, and what one watch sees of a change. Builders for the objects tests put there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

SLICES = "endpointslices"
NODES = "nodes"


def endpoint(address: str, *, pod: str | None = None, ready: bool | None = True,
             serving: bool | None = None, terminating: bool | None = None,
             zone: str | None = None, node: str | None = None,
             namespace: str = "default") -> Obj:
    """One EndpointSlice endpoint (``discovery.k8s.io/v1`` ``Endpoint``); a condition given
    as None is left out (the API's nil)."""
    cond = {k: v for k, v in (("ready", ready), ("serving", serving),
                              ("terminating", terminating)) if v is not None}
    ep: Obj = {"addresses": [address], "conditions": cond}
    if pod is not None:
        ep["targetRef"] = {"kind": "Pod", "name": pod, "namespace": namespace}
    if zone is not None:
        ep["zone"] = zone
    if node is not None:
        ep["nodeName"] = node
    return ep


def slice_object(name: str, endpoints: Iterable[Obj], ports: Iterable[Obj],
                 labels: Mapping[str, str], namespace: str, address_type: str) -> Obj:
    """An EndpointSlice as the API serves it."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "addressType": address_type, "endpoints": [dict(e) for e in endpoints],
        "ports": [dict(p) for p in ports],
    }


def node_object(name: str, labels: Mapping[str, str], taints: Iterable[Obj],
                conditions: Iterable[Obj]) -> Obj:
    """A Node as the API serves it (a taint needs ``key`` and ``effect``; a condition
    ``type`` and ``status``)."""
    return {
        "kind": "Node", "apiVersion": "v1",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {"taints": [dict(t) for t in taints]},
        "status": {"conditions": [dict(c) for c in conditions]},
    }


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """A label selector of equality (``k=v``, ``k==v``, ``k!=v``) and existence (``k``,
    ``!k``) terms, comma-separated, against ``labels``."""
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def labels_of(obj: Obj | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("labels") or {})


@dataclass
class Change:
    """One change at resourceVersion ``rv``: ``kind`` ADDED | MODIFIED | DELETED of ``obj``
    (``old``: the object before it)."""

    rv: int
    resource: str
    namespace: str | None
    kind: str
    obj: Obj
    old: Obj | None


class KubeStore:
    """Objects, resourceVersions and the retained history of changes."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[tuple[str | None, str], Obj]] = {SLICES: {}, NODES: {}}
        self.rv = 1
        self.history: list[Change] = []
        self.compacted_rv = 0
        """A watch from a resourceVersion older than this gets 410 Gone."""

    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, resource: str, namespace: str | None, obj: Obj) -> Change:
        key = (namespace, obj["metadata"]["name"])
        old = self.objects[resource].get(key)
        rv = self.next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        self.objects[resource][key] = obj
        change = Change(rv, resource, namespace, "MODIFIED" if old else "ADDED", obj, old)
        self.history.append(change)
        return change

    def delete(self, resource: str, namespace: str | None, name: str) -> Change:
        old = self.objects[resource].pop((namespace, name))
        rv = self.next_rv()
        gone = json.loads(json.dumps(old))
        gone["metadata"]["resourceVersion"] = str(rv)
        change = Change(rv, resource, namespace, "DELETED", gone, old)
        self.history.append(change)
        return change

    def compact(self) -> None:
        """Forget the history up to now."""
        self.history.clear()
        self.compacted_rv = self.rv

    def items(self, resource: str, namespace: str | None, selector: str) -> list[Obj]:
        """What a list answers, by name."""
        return [o for (ns, _), o in sorted(self.objects[resource].items(),
                                           key=lambda kv: kv[0][1])
                if ns == namespace and selector_matches(selector, labels_of(o))]

    def backlog(self, resource: str, since: int | None) -> list[Change]:
        """What a watch from ``since`` replays first (None: synthetic ADDED of every
        object, the API's "any" resourceVersion)."""
        if since is None:
            return [Change(self.rv, resource, ns, "ADDED", o, None)
                    for (ns, _), o in self.objects[resource].items()]
        return [c for c in self.history if c.rv > since]

    @staticmethod
    def seen_as(c: Change, resource: str, namespace: str | None,
                selector: str) -> tuple[str, Obj] | None:
        """(event type, object) a watch of ``resource`` in ``namespace`` with ``selector``
        gets of ``c``; None: nothing. An object that starts or stops matching the selector
        is ADDED / DELETED, as the API server's watch cache sends it."""
        if c.resource != resource or c.namespace != namespace:
            return None
        now = c.kind != "DELETED" and selector_matches(selector, labels_of(c.obj))
        before = c.old is not None and selector_matches(selector, labels_of(c.old))
        if now and before:
            return "MODIFIED", c.obj
        if now:
            return "ADDED", c.obj
        if before:
            return "DELETED", c.obj
        return None


__all__ = ["NODES", "SLICES", "Change", "KubeStore", "Obj", "endpoint", "node_object",
           "selector_matches", "slice_object"]
