"""Kubernetes discovery at the source: :class:`~gateway.fleet.kube_source.KubeSource` with the
real client library (``kubernetes_asyncio``) against the local API server DOUBLE
(``tests/support/kube_api.py``: list + watch of EndpointSlices, resourceVersions, bookmarks,
410 Gone), reporting to a recording sink."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.fleet.discovery import Endpoint
from tests.discovery.kube_support import running_source, until
from tests.support.kube_api import SLICES, KubeApiDouble, endpoint


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


async def test_the_list_reports_every_slice_merged_with_conditions_and_placement(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_slice("vllm-a", [
        endpoint("10.0.0.1", pod="vllm-0", zone="us-east-1a", node="n1"),
        endpoint("10.0.0.2", pod="vllm-1", ready=False, serving=True, terminating=True,
                 zone="us-east-1b", node="n2"),
    ])
    kube.put_slice("vllm-b", [endpoint("10.0.0.3", pod="vllm-2", ready=None)])  # nil: ready
    kube.put_slice("other", [endpoint("10.0.9.9", pod="x")], labels={"app": "other"})
    async with running_source(kube, tmp_path) as (_, sink):
        assert await until(lambda: bool(sink.of("endpoints")))
        first = sink.of("endpoints")[0]
    assert [e.id for e in first] == ["vllm-0", "vllm-1", "vllm-2"]
    assert first[0] == Endpoint(id="vllm-0", url="http://10.0.0.1:8000", host="10.0.0.1",
                                zone="us-east-1a", node="n1", pod="vllm-0",
                                namespace="default")
    assert (first[1].ready, first[1].serving, first[1].terminating) == (False, True, True)
    assert (first[2].ready, first[2].serving, first[2].terminating) == (True, True, False)
    assert sink.of("outage") == []


async def test_watch_events_add_modify_and_remove_endpoints_without_a_relist(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0")])
    async with running_source(kube, tmp_path) as (_, sink):
        assert await until(lambda: kube.open_watches() == 1)
        kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0"),
                                  endpoint("10.0.0.2", pod="vllm-1", ready=False)])
        assert await until(lambda: set(sink.fleet) == {"vllm-0", "vllm-1"})
        assert sink.fleet["vllm-1"].ready is False
        kube.put_slice("vllm-b", [endpoint("10.0.0.3", pod="vllm-2")])  # a second slice
        assert await until(lambda: set(sink.fleet) == {"vllm-0", "vllm-1", "vllm-2"})
        kube.put_slice("vllm-a", [
            endpoint("10.0.0.1", pod="vllm-0", ready=False, serving=True, terminating=True),
            endpoint("10.0.0.2", pod="vllm-1")])
        assert await until(lambda: sink.fleet["vllm-0"].terminating
                           and sink.fleet["vllm-1"].ready)
        kube.delete_slice("vllm-a")
        assert await until(lambda: set(sink.fleet) == {"vllm-2"})
        kube.put_slice("vllm-b", [endpoint("10.0.0.3", pod="vllm-2")],
                       labels={"app": "moved"})  # stops matching: DELETED for this watch
        assert await until(lambda: sink.fleet == {} and len(sink.of("endpoints")) == 6)
    assert len(kube.calls(SLICES, watch=False)) == 1
    assert sink.of("outage") == []


async def test_port_name_picks_the_named_port_and_ipv6_is_bracketed(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    ports = [{"name": "metrics", "port": 9400}, {"name": "http", "port": 8000}]
    kube.put_slice("v4", [endpoint("10.0.0.1", pod="vllm-0")], ports=ports)
    kube.put_slice("v6", [endpoint("fd00::7", pod="vllm-6")], ports=ports, address_type="IPv6")
    async with running_source(kube, tmp_path, port_name="http") as (_, sink):
        assert await until(lambda: len(sink.fleet) == 2)
    assert sink.fleet["vllm-0"].url == "http://10.0.0.1:8000"
    assert sink.fleet["vllm-6"].url == "http://[fd00::7]:8000"
    assert sink.fleet["vllm-6"].host == "fd00::7"


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_catches_up(tmp_path: Path, gone_as_status: bool) -> None:
    with KubeApiDouble(gone_as_status=gone_as_status) as kube:
        kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0")])
        async with running_source(kube, tmp_path) as (_, sink):
            assert await until(lambda: kube.open_watches() == 1)
            kube.end_watches()  # the watch ends; meanwhile history moves on and is compacted
            kube.put_slice("vllm-b", [endpoint("10.0.0.2", pod="vllm-1")])
            kube.compact()
            assert await until(lambda: set(sink.fleet) == {"vllm-0", "vllm-1"})
            assert await until(lambda: kube.open_watches() == 1)
        watches = kube.calls(SLICES, watch=True)
    assert len(kube.calls(SLICES, watch=False)) == 2, watches
    assert sink.of("outage") == []


async def test_a_watch_that_ends_continues_from_the_last_resource_version(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0")])
    async with running_source(kube, tmp_path, watch_timeout_s=1) as (_, sink):
        assert await until(lambda: kube.open_watches() == 1)
        rv = kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0", ready=False)])
        assert await until(lambda: not sink.fleet["vllm-0"].ready)
        assert await until(lambda: len(kube.calls(SLICES, watch=True)) >= 2)
    watches = kube.calls(SLICES, watch=True)
    assert watches[0]["timeoutSeconds"] == "1"
    assert watches[0]["allowWatchBookmarks"].lower() == "true"
    assert watches[1]["resourceVersion"] == str(rv)
    assert len(kube.calls(SLICES, watch=False)) == 1


async def test_a_bookmark_advances_the_resource_version_so_no_relist_is_needed(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0")])
    async with running_source(kube, tmp_path) as (_, sink):
        assert await until(lambda: kube.open_watches() == 1)
        for i in range(3):  # changes this watch never sees (another selector)
            kube.put_slice(f"other-{i}", [endpoint(f"10.0.9.{i}")], labels={"app": "other"})
        kube.bookmark()
        await until(lambda: False, within_s=0.5)  # the bookmark reaches the source
        kube.compact()
        kube.end_watches()
        assert await until(lambda: len(kube.calls(SLICES, watch=True)) >= 2
                           and kube.open_watches() == 1)
    watches = kube.calls(SLICES, watch=True)
    assert watches[1]["resourceVersion"] == str(kube.resource_version)
    assert len(kube.calls(SLICES, watch=False)) == 1  # without the bookmark: 410 and a relist
    assert len(sink.of("endpoints")) == 1


async def test_a_dropped_connection_is_an_outage_that_keeps_the_fleet_then_a_relist(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kube.put_slice("vllm-a", [endpoint("10.0.0.1", pod="vllm-0"),
                              endpoint("10.0.0.2", pod="vllm-1")])
    async with running_source(kube, tmp_path) as (_, sink):
        assert await until(lambda: kube.open_watches() == 1)
        kube.set_down(True)  # cuts the watch; every reconnect is cut too
        assert await until(lambda: len(sink.of("outage")) >= 2)  # retried every retry_s
        reported = len(sink.of("endpoints"))
        kube.put_slice("vllm-a", [endpoint("10.0.0.2", pod="vllm-1")])
        kube.set_down(False)
        assert await until(lambda: set(sink.fleet) == {"vllm-1"})
    assert reported == 1  # nothing reported during the outage: the last fleet stands
    assert all("\n" not in r for r in sink.of("outage")), sink.of("outage")
    kinds = [k for k, _ in sink.calls]
    assert kinds[0] == "endpoints" and kinds[-1] == "endpoints" and "outage" in kinds
    assert len(kube.calls(SLICES, watch=False)) >= 2


async def test_a_refused_token_is_an_outage_with_its_status(
        kube: KubeApiDouble, tmp_path: Path) -> None:
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "stale-kubeconfig"))
    kube.token = "another-token"  # the kubeconfig's token is no longer accepted
    async with running_source(kube, tmp_path, kubeconfig=kubeconfig) as (_, sink):
        assert await until(lambda: bool(sink.of("outage")))
    assert sink.of("outage")[0].startswith("HTTP 401"), sink.of("outage")
    assert sink.of("endpoints") == []
