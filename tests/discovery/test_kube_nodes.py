"""The node watch of Kubernetes discovery: placement labels -> ``NodeInfo``, spot
interruption taints and conditions -> one ``SpotNotice`` per node and notice; the real client
library against the local API server DOUBLE (``tests/support/kube_api.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.discovery import NodeInfo, SpotNotice
from gateway.fleet.kube_objects import NOTICE_CONDITIONS, NOTICE_TAINTS
from tests.discovery.kube_support import running_source, until
from tests.support.kube_api import NODES, KubeApiDouble, endpoint


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


SPOT_A = {"topology.kubernetes.io/zone": "us-east-1a", "karpenter.sh/capacity-type": "spot",
          "node.kubernetes.io/instance-type": "p4d.24xlarge"}


async def test_node_labels_become_node_info(kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_node("n1", labels=SPOT_A)
    kube.put_node("n2", labels={"failure-domain.beta.kubernetes.io/zone": "europe-west4-b",
                                "cloud.google.com/gke-spot": "true"})
    kube.put_node("n3", labels={"topology.kubernetes.io/zone": "us-east-1b",
                                "eks.amazonaws.com/capacityType": "ON_DEMAND"})
    kube.put_slice("vllm", [endpoint("10.0.0.1", pod="vllm-0", node="n1")])
    async with running_source(kube, tmp_path, watch_nodes=True) as (_, sink):
        assert await until(lambda: bool(sink.of("nodes")) and kube.open_watches(NODES) == 1)
        assert sink.of("nodes")[0] == {
            "n1": NodeInfo("n1", "us-east-1a", "spot", "p4d.24xlarge"),
            "n2": NodeInfo("n2", "europe-west4-b", "spot", None),
            "n3": NodeInfo("n3", "us-east-1b", "on-demand", None),
        }
        kube.put_node("n3", labels={"topology.kubernetes.io/zone": "us-east-1b",
                                    "kubernetes.azure.com/scalesetpriority": "spot"})
        assert await until(lambda: sink.of("nodes")[-1]["n3"].capacity_type == "spot")
        kube.delete_node("n2")
        assert await until(lambda: set(sink.of("nodes")[-1]) == {"n1", "n3"})
    assert sink.of("spot_notice") == []
    assert len(sink.of("endpoints")) == 1  # node changes are not endpoint changes


NOTICES: list[tuple[str, dict[str, Any]]] = [
    *((key, {"taints": [{"key": key, "value": value or "i-0abc", "effect": "NoSchedule"}]})
      for key, value in NOTICE_TAINTS),
    *((f"condition:{ctype}", {"conditions": [{"type": ctype, "status": "True",
                                              "reason": reason or "Any"}]})
      for ctype, reason in NOTICE_CONDITIONS),
]


@pytest.mark.parametrize(("reason", "marks"), NOTICES, ids=[r for r, _ in NOTICES])
async def test_each_notice_is_reported_once_per_node(
        kube: KubeApiDouble, tmp_path: Path, reason: str, marks: dict[str, Any]) -> None:
    kube.put_node("n1", labels=SPOT_A)
    kube.put_node("n2", labels={**SPOT_A, "topology.kubernetes.io/zone": "us-east-1b"})
    async with running_source(kube, tmp_path, watch_nodes=True) as (source, sink):
        assert await until(lambda: kube.open_watches(NODES) == 1)
        kube.put_node("n1", labels=SPOT_A, **marks)
        want = SpotNotice(zone="us-east-1a", node="n1", instance_type="p4d.24xlarge",
                          reason=reason, capacity_type="spot")
        assert await until(lambda: sink.of("spot_notice") == [want])
        # the node keeps changing (labels, a heartbeat's status): no second notice
        kube.put_node("n1", labels={**SPOT_A, "extra": "1"}, **marks)
        kube.put_node("n2", labels={**SPOT_A, "topology.kubernetes.io/zone": "us-east-1b"})
        assert source.nodes is not None
        nodes = source.nodes
        assert await until(lambda: nodes.objects["n1"]["metadata"]["labels"].get("extra") == "1"
                           and nodes.objects["n2"]["metadata"]["labels"][
                               "topology.kubernetes.io/zone"] == "us-east-1b")
        # a relist (410) sees the same notice: still not again
        kube.end_watches()
        kube.put_node("n3")
        kube.compact()
        assert await until(lambda: nodes.lists == 2 and kube.open_watches(NODES) == 1)
        assert sink.of("spot_notice") == [want]
        # the notice goes away and comes back: reported again
        kube.put_node("n1", labels=SPOT_A)
        kube.put_node("n1", labels=SPOT_A, **marks)
        assert await until(lambda: sink.of("spot_notice") == [want, want])


async def test_a_taint_that_is_not_a_notice_reports_none(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_node("n1", labels=SPOT_A, taints=[
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": "karpenter.sh/disruption", "value": "candidate", "effect": "NoSchedule"},
        {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot",
         "effect": "NoSchedule"}],
        conditions=[{"type": "Terminating", "status": "False", "reason": "TerminationRequested"}])
    async with running_source(kube, tmp_path, watch_nodes=True) as (_, sink):
        assert await until(lambda: bool(sink.of("nodes")) and kube.open_watches(NODES) == 1)
    assert sink.of("spot_notice") == []


async def test_a_node_watch_refused_by_rbac_is_no_outage_of_the_fleet(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.forbidden.add(NODES)  # no ClusterRole for nodes
    kube.put_slice("vllm", [endpoint("10.0.0.1", pod="vllm-0", node="n1")])
    async with running_source(kube, tmp_path, watch_nodes=True) as (_, sink):
        assert await until(lambda: len(kube.calls(NODES, watch=False)) >= 2)  # retried
        assert await until(lambda: kube.open_watches() == 1)
        kube.put_slice("vllm", [endpoint("10.0.0.1", pod="vllm-0", node="n1"),
                                endpoint("10.0.0.2", pod="vllm-1", node="n1")])
        assert await until(lambda: set(sink.fleet) == {"vllm-0", "vllm-1"})
        kube.forbidden.clear()  # the ClusterRole is granted: the nodes come
        kube.put_node("n1", labels=SPOT_A)
        assert await until(lambda: bool(sink.of("nodes")))
    assert sink.of("outage") == []
    assert sink.of("nodes")[-1] == {"n1": NodeInfo("n1", "us-east-1a", "spot", "p4d.24xlarge")}
