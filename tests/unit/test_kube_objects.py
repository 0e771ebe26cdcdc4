"""Pure decisions of Kubernetes discovery (``gateway/fleet/kube_objects.py``): EndpointSlices
(the API's JSON) -> endpoints, node labels -> ``NodeInfo``, taints and conditions -> spot
interruption notices. The keys are spelled out here as their sources give them (not read
from the module's tables), so a wrong table entry fails."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.fleet.discovery import Endpoint, NodeInfo
from gateway.fleet.kube_objects import (
    capacity_type,
    merge_slices,
    node_info,
    notice_reasons,
    slice_endpoints,
)


def slice_(name: str, *eps: dict[str, Any], ports: Any = ({"name": "http", "port": 8000},),
           address_type: str = "IPv4") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "llm"}, "addressType": address_type,
            "endpoints": list(eps), "ports": list(ports)}


def ep(address: str, pod: str | None = None, **cond: bool) -> dict[str, Any]:
    e: dict[str, Any] = {"addresses": [address], "conditions": cond}
    if pod:
        e["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "llm"}
    return e


def test_nil_conditions_read_as_the_api_says_ready_serving_not_terminating() -> None:
    (e,) = slice_endpoints(slice_("s", {"addresses": ["10.0.0.1"]}), None, "http")
    assert (e.ready, e.serving, e.terminating) == (True, True, False)
    (e,) = slice_endpoints(slice_("s", ep("10.0.0.1", ready=False, terminating=True)),
                           None, "http")
    assert (e.ready, e.serving, e.terminating) == (False, True, True)


def test_id_is_the_pod_else_address_and_port() -> None:
    s = slice_("s", ep("10.0.0.1", pod="vllm-0"), ep("10.0.0.2"),
               {"addresses": ["10.0.0.3"], "targetRef": {"kind": "Node", "name": "n"}})
    got = slice_endpoints(s, None, "https")
    assert [e.id for e in got] == ["vllm-0", "10.0.0.2-8000", "10.0.0.3-8000"]
    assert got[0] == Endpoint("vllm-0", "https://10.0.0.1:8000", "10.0.0.1",
                              pod="vllm-0", namespace="llm")
    assert got[1].pod is None and got[1].namespace is None


def test_port_by_name_else_the_first_and_a_slice_without_it_gives_none() -> None:
    ports = [{"name": "metrics", "port": 9400}, {"name": "http", "port": 8000}]
    s = slice_("s", ep("10.0.0.1", pod="p"), ports=ports)
    assert slice_endpoints(s, "http", "http")[0].url == "http://10.0.0.1:8000"
    assert slice_endpoints(s, None, "http")[0].url == "http://10.0.0.1:9400"
    assert slice_endpoints(s, "grpc", "http") == []
    assert slice_endpoints(slice_("s", ep("10.0.0.1"), ports=()), None, "http") == []


def test_ipv6_is_bracketed_in_the_url_and_the_id_has_no_colons() -> None:
    (e,) = slice_endpoints(slice_("s", ep("fd00::1"), address_type="IPv6"), None, "http")
    assert (e.url, e.host, e.id) == ("http://[fd00::1]:8000", "fd00::1", "fd00--1-8000")


def test_merge_keeps_each_id_once_in_its_best_condition() -> None:
    slices = {
        "b": slice_("b", ep("10.0.0.1", pod="vllm-0", ready=True), ep("10.0.0.2", pod="vllm-1")),
        "a": slice_("a", ep("10.0.0.9", pod="vllm-0", ready=False)),
    }
    got = merge_slices(slices, None, "http")
    assert [(e.id, e.ready, e.host) for e in got] == [("vllm-0", True, "10.0.0.1"),
                                                      ("vllm-1", True, "10.0.0.2")]


@pytest.mark.parametrize(("labels", "want"), [
    ({"karpenter.sh/capacity-type": "spot"}, "spot"),
    ({"karpenter.sh/capacity-type": "on-demand"}, "on-demand"),
    ({"karpenter.sh/capacity-type": "reserved"}, "on-demand"),
    ({"eks.amazonaws.com/capacityType": "SPOT"}, "spot"),
    ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, "on-demand"),
    ({"cloud.google.com/gke-spot": "true"}, "spot"),
    ({"cloud.google.com/gke-preemptible": "true"}, "spot"),
    ({"kubernetes.azure.com/scalesetpriority": "spot"}, "spot"),
    ({"kubernetes.azure.com/scalesetpriority": "regular"}, "on-demand"),
    ({"cloud.google.com/gke-spot": "false"}, None),
    ({}, None),
])
def test_capacity_type_from_the_provisioners_labels(labels: dict[str, str],
                                                    want: str | None) -> None:
    assert capacity_type(labels) == want


def test_node_info_zone_falls_back_to_the_legacy_label() -> None:
    node = {"metadata": {"name": "n1", "labels": {
        "failure-domain.beta.kubernetes.io/zone": "us-central1-a",
        "node.kubernetes.io/instance-type": "a2-highgpu-1g"}}}
    assert node_info(node) == NodeInfo("n1", "us-central1-a", None, "a2-highgpu-1g")
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = "us-central1-b"
    assert node_info(node).zone == "us-central1-b"


@pytest.mark.parametrize(("key", "value"), [
    ("aws-node-termination-handler/spot-itn", "i-0abc"),
    ("aws-node-termination-handler/rebalance-recommendation", "i-0abc"),
    ("aws-node-termination-handler/asg-lifecycle-termination", "i-0abc"),
    ("karpenter.sh/disrupted", ""),
    ("karpenter.sh/disruption", "disrupting"),
    ("cloud.google.com/impending-node-termination", ""),
])
def test_the_usual_handlers_taints_are_notices(key: str, value: str) -> None:
    node = {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"},
                                {"key": key, "value": value, "effect": "NoSchedule"}]}}
    assert notice_reasons(node) == [key]


def test_what_is_not_a_notice() -> None:
    node = {"spec": {"taints": [
        {"key": "karpenter.sh/disruption", "value": "candidate", "effect": "NoSchedule"},
        {"key": "aws-node-termination-handler/scheduled-maintenance", "effect": "NoSchedule"},
        {"key": "kubernetes.azure.com/scalesetpriority", "value": "spot",
         "effect": "NoSchedule"},
    ]}, "status": {"conditions": [
        {"type": "Terminating", "status": "False", "reason": "TerminationRequested"},
        {"type": "Ready", "status": "True"}]}}
    assert notice_reasons(node) == []
    assert notice_reasons({}) == []


def test_openshift_terminating_condition_is_a_notice() -> None:
    node = {"status": {"conditions": [
        {"type": "Terminating", "status": "True", "reason": "TerminationRequested"}]}}
    assert notice_reasons(node) == ["condition:Terminating"]
