"""Kubernetes discovery end to end: the real gateway under uvicorn with its real Kubernetes
source (``kubernetes_asyncio``) watching the local API server DOUBLE
(``tests/support/kube_api.py``: list + watch of EndpointSlices and nodes, resourceVersions,
bookmarks, 410 Gone), whose EndpointSlices point at simulated vLLM servers on distinct
loopback addresses sharing one port (the pods behind a Service), the openai SDK as client.

What is checked is the gateway's routing, seen from the backends' own records of what they
served (``/sim/stats``) and the clients' answers: a new endpoint gets requests after its
warm-up, a terminating one gets none once its drain began and leaves the fleet when its
endpoint goes, no request fails meanwhile, a cut API server keeps the fleet serving, and a
compacted history (410) is caught up by a relist."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.discovery.test_dns_discovery import Load, backends, chats
from tests.lifecycle.support import Sim, metric, metric_samples, wait_for
from tests.support.kube_api import KubeApiDouble, endpoint
from tests.support.servers import GatewayThread, gateway_config


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


def ep(pod: Sim, name: str, node: str, **conditions: bool) -> dict[str, object]:
    """``pod``'s endpoint in a slice: its address, its pod ``name`` on ``node``."""
    zone = {"n1": "zone-a", "n2": "zone-b"}[node]
    return endpoint(pod.host, pod=name, node=node, zone=zone, **conditions)


def warm(gw: GatewayThread) -> set[str]:
    return {i for i, b in backends(gw).items() if b["state"] == "warm"}


def discovery_up(gw: GatewayThread) -> float | None:
    return metric(metric_samples(gw.url), "gateway_discovery_up", source="kubernetes")


def test_endpointslice_changes_move_traffic_without_failing_a_request(
        kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path) -> None:
    a, b = pods("127.0.0.2"), pods("127.0.0.3", itl_s=0.04)
    ports = [{"name": "http", "port": a.port}]
    kube.put_node("n1", labels={"topology.kubernetes.io/zone": "zone-a",
                                "karpenter.sh/capacity-type": "spot",
                                "node.kubernetes.io/instance-type": "g6.xlarge"})
    kube.put_node("n2", labels={"topology.kubernetes.io/zone": "zone-b",
                                "karpenter.sh/capacity-type": "on-demand"})
    kube.put_slice("vllm-x1", [ep(a, "vllm-a", "n1"), ep(b, "vllm-b", "n2")], ports=ports)
    cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "namespace": "default", "label_selector": "app.kubernetes.io/name=vllm",
        "port_name": "http", "retry_s": 0.2, "watch_timeout_s": 30}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: warm(gw) == {"vllm-a", "vllm-b"}, 20), backends(gw)
        placed = gw.gateway.fleet.get("vllm-a")
        assert placed is not None
        assert wait_for(lambda: placed.placement.spot, 10), placed.placement
        assert placed.placement.zone == "zone-a"
        assert placed.placement.instance_type == "g6.xlarge"

        load = Load(gw.url, workers=4, max_tokens=16)
        try:
            assert wait_for(lambda: load.ok >= 10, 20)

            # a new pod in another slice: it enters cold, warms up, then takes requests
            c = pods("127.0.0.4")
            kube.put_slice("vllm-x2", [ep(c, "vllm-c", "n2")], ports=ports)
            assert wait_for(lambda: "vllm-c" in backends(gw), 10)
            assert wait_for(lambda: backends(gw)["vllm-c"]["state"] == "warm", 15)
            assert wait_for(lambda: chats(c) >= 3, 15)
            hist = httpx.get(f"{gw.url}/admin/backends/vllm-c", timeout=5).json()["history"]
            moves = [(h["from"], h["to"]) for h in hist]
            assert moves[:2] == [("cold", "warming"), ("warming", "warm")], moves

            # b terminates while its streams run (still serving): drained, never cut
            assert wait_for(lambda: backends(gw)["vllm-b"]["in_flight"] >= 1, 15)
            kube.put_slice("vllm-x1", [
                ep(a, "vllm-a", "n1"),
                ep(b, "vllm-b", "n2", ready=False, serving=True, terminating=True)],
                ports=ports)
            assert wait_for(lambda: backends(gw)["vllm-b"]["state"] == "draining", 5)
            served = chats(b)  # every request b got reached it before its drain began
            assert wait_for(lambda: backends(gw)["vllm-b"]["in_flight"] == 0, 15)
            before = load.ok
            assert wait_for(lambda: load.ok >= before + 10, 20)
            assert chats(b) == served, "a request reached a terminating pod"

            # its endpoint goes: b leaves the fleet
            kube.put_slice("vllm-x1", [ep(a, "vllm-a", "n1")], ports=ports)
            assert wait_for(lambda: "vllm-b" not in backends(gw), 15), backends(gw)

            # the API server is cut: an outage, the fleet kept and serving
            kube.set_down(True)
            assert wait_for(lambda: discovery_up(gw) == 0, 10)
            before = load.ok
            assert wait_for(lambda: load.ok >= before + 10, 20)
            assert set(backends(gw)) == {"vllm-a", "vllm-c"}
            # meanwhile its history moves on and is compacted: the relist catches up
            kube.delete_slice("vllm-x2")
            kube.compact()
            kube.set_down(False)
            assert wait_for(lambda: discovery_up(gw) == 1, 10)
            assert wait_for(lambda: set(backends(gw)) == {"vllm-a"}, 15), backends(gw)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.ok > 0
    finally:
        gw.stop()


def test_the_restart_hook_deletes_a_discovered_backends_pod(
        kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path) -> None:
    """A discovered backend's pod and namespace come from its EndpointSlice ``targetRef``:
    the long cycle's ``delete_pod`` hook deletes exactly that pod through the API."""
    a, b = pods("127.0.0.2"), pods("127.0.0.3")
    ports = [{"name": "http", "port": a.port}]
    kube.put_slice("vllm-x1", [endpoint(a.host, pod="vllm-a", namespace="llm"),
                               endpoint(b.host, pod="vllm-b", namespace="llm")],
                   ports=ports, namespace="llm")
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config(
        [], discovery={"source": "kubernetes", "kubernetes": {
            "kubeconfig": kubeconfig, "namespace": "llm", "retry_s": 0.2,
            "watch_nodes": False}},
        lifecycle={"long": {"every_s": 3.0}, "check_interval_s": 0.1, "restart_hold_s": 0.5,
                   "restart_hook": {"delete_pod": True, "kubeconfig": kubeconfig}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: warm(gw) == {"vllm-a", "vllm-b"}, 20), backends(gw)
        assert wait_for(lambda: {p for _, p in kube.deleted_pods} == {"vllm-a", "vllm-b"},
                        20), kube.deleted_pods
        assert {ns for ns, _ in kube.deleted_pods} == {"llm"}
    finally:
        gw.stop()


def test_a_spot_interruption_taint_preempts_the_nodes_backends_without_failing_a_request(
        kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path) -> None:
    """aws-node-termination-handler taints node n1 (``aws-node-termination-handler/spot-itn``):
    through the real node watch the gateway preempts the backend on n1 (no request reaches it
    once its drain began), counts one interruption for its zone and instance type, and lowers
    that zone's spot score; the node changing again is no second notice."""
    a, b, c = pods("127.0.0.2"), pods("127.0.0.3"), pods("127.0.0.4")
    spot_a = {"topology.kubernetes.io/zone": "zone-a", "karpenter.sh/capacity-type": "spot",
              "node.kubernetes.io/instance-type": "g6.xlarge"}
    kube.put_node("n1", labels=spot_a)
    kube.put_node("n3", labels=spot_a)
    kube.put_node("n2", labels={"topology.kubernetes.io/zone": "zone-b",
                                "karpenter.sh/capacity-type": "on-demand"})
    kube.put_slice("vllm-x1", [endpoint(a.host, pod="vllm-a", node="n1", zone="zone-a"),
                               endpoint(b.host, pod="vllm-b", node="n2", zone="zone-b"),
                               endpoint(c.host, pod="vllm-c", node="n3", zone="zone-a")],
                   ports=[{"name": "http", "port": a.port}])
    cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "namespace": "default", "retry_s": 0.2}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: warm(gw) == {"vllm-a", "vllm-b", "vllm-c"}, 20), backends(gw)
        placed = gw.gateway.fleet.get("vllm-a")
        assert placed is not None and wait_for(lambda: placed.placement.spot, 10)
        load = Load(gw.url, workers=3, max_tokens=16)
        try:
            assert wait_for(lambda: chats(a) >= 3 and load.ok >= 10, 20)
            kube.put_node("n1", labels=spot_a, taints=[{
                "key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-1",
                "effect": "NoSchedule"}])
            assert wait_for(lambda: backends(gw)["vllm-a"]["hold"] == "preempted", 10), \
                backends(gw)["vllm-a"]
            assert wait_for(lambda: backends(gw)["vllm-a"]["in_flight"] == 0, 15)
            served = chats(a)  # what a got before its drain began, and its last streams
            kube.put_node("n1", labels={**spot_a, "changed": "1"}, taints=[{
                "key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-1",
                "effect": "NoSchedule"}])
            before = load.ok
            assert wait_for(lambda: load.ok >= before + 15, 20)
            assert chats(a) == served, "a request reached a preempted backend"
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        samples = metric_samples(gw.url)
        assert metric(samples, "gateway_spot_interruptions_total", zone="zone-a",
                      instance_type="g6.xlarge") == 1.0
        score = metric(samples, "gateway_spot_zone_score", zone="zone-a")
        assert score is not None and score < 1.0
    finally:
        gw.stop()
