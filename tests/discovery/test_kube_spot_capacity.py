"""A disruption taint on an on-demand node is no spot interruption (issue 15, item 2): the
real gateway under uvicorn with its real Kubernetes source (``kubernetes_asyncio``) watching
the local API server DOUBLE (``tests/support/kube_api.py``, standing in for a cluster's API
server), whose EndpointSlices point at simulated vLLM servers.

Karpenter taints every node it disrupts with ``karpenter.sh/disrupted`` (consolidation,
drift and expiry as well as interruption; karpenter.sh, "Disruption"), and
aws-node-termination-handler taints nodes an ASG scales in. Such a taint on a node labelled
``on-demand`` says that node goes (its backend is preempted) but nothing about the zone's
spot capacity: the zone's spot score and ``gateway_spot_interruptions_total`` stay as they
were, so routine consolidation does not move traffic off the zone's healthy spot backends.
The same taint on a spot node still counts and lowers the score."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.discovery.test_dns_discovery import backends
from tests.lifecycle.support import Sim, metric, metric_samples, wait_for
from tests.support.kube_api import KubeApiDouble, endpoint
from tests.support.servers import GatewayThread, gateway_config

DISRUPTED = [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


def zone_a_score(gw: GatewayThread) -> float:
    zones = httpx.get(gw.url + "/admin/zones", timeout=5).json()["zones"]
    return next(float(z["score"]) for z in zones if z["zone"] == "zone-a")


def test_a_disrupted_on_demand_node_preempts_its_backend_without_lowering_the_spot_score(
        kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path) -> None:
    spot, od = pods("127.0.0.2"), pods("127.0.0.3")
    labels = {"topology.kubernetes.io/zone": "zone-a",
              "node.kubernetes.io/instance-type": "g6.xlarge"}
    kube.put_node("n1", labels={**labels, "karpenter.sh/capacity-type": "spot"})
    kube.put_node("n2", labels={**labels, "karpenter.sh/capacity-type": "on-demand"})
    kube.put_slice("vllm-x1", [endpoint(spot.host, pod="vllm-spot", node="n1", zone="zone-a"),
                               endpoint(od.host, pod="vllm-od", node="n2", zone="zone-a")],
                   ports=[{"name": "http", "port": spot.port}])
    cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "namespace": "default", "retry_s": 0.2}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: {i for i, b in backends(gw).items() if b["state"] == "warm"}
                        == {"vllm-spot", "vllm-od"}, 20), backends(gw)
        placed = gw.gateway.fleet.get("vllm-od")
        assert placed is not None
        assert wait_for(lambda: placed.placement.capacity_type == "on-demand", 10)
        # Karpenter consolidates the on-demand node: its backend goes, the spot pool is fine
        kube.put_node("n2", labels={**labels, "karpenter.sh/capacity-type": "on-demand"},
                      taints=DISRUPTED)
        assert wait_for(lambda: backends(gw)["vllm-od"]["hold"] == "preempted", 10), \
            backends(gw)["vllm-od"]
        assert zone_a_score(gw) == 1.0
        samples = metric_samples(gw.url)
        assert metric(samples, "gateway_spot_interruptions_total", zone="zone-a",
                      instance_type="g6.xlarge") is None
        assert backends(gw)["vllm-spot"]["hold"] is None
        # the same taint on the spot node: a spot interruption, counted and scored
        kube.put_node("n1", labels={**labels, "karpenter.sh/capacity-type": "spot"},
                      taints=DISRUPTED)
        assert wait_for(lambda: backends(gw)["vllm-spot"]["hold"] == "preempted", 10)
        assert zone_a_score(gw) == pytest.approx(0.5, abs=0.01)
        samples = metric_samples(gw.url)
        assert metric(samples, "gateway_spot_interruptions_total", zone="zone-a",
                      instance_type="g6.xlarge") == 1.0
    finally:
        gw.stop()
