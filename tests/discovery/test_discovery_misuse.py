"""What a user gets wrong with discovery, and what the gateway then says or does.

* Configs ``check-config`` used to accept and ``serve`` then could not use (a crash at start,
  an endless outage, every discovered endpoint left out): each is refused by both commands
  with the field's name (exit status 2).
* A backend discovery is taking out (its endpoint terminating or gone) stays out: the admin
  API refuses to undrain it (409 ``backend_leaving``, OpenAI error shape), and one whose
  other hold ends (a preemption's) is held out again, never back in rotation.
* The API server's own explanation of a refusal (RBAC) reaches ``/ready`` and the restart
  hook's error, not only "HTTP 403".
* An endpoint without ``nodeName`` is served (only its GPU telemetry is unknown).

Real HTTP through uvicorn, simulated vLLM servers, and the local Kubernetes API server
DOUBLE (``tests/support/kube_api.py``) standing in for a cluster's API server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli import main
from tests.discovery.test_dns_discovery import backends, chats
from tests.lifecycle.support import MODEL, Sim, admin, wait_for
from tests.support.kube_api import KubeApiDouble, endpoint
from tests.support.redis_server import RedisServer
from tests.support.servers import GatewayThread, gateway_config

DNS = "discovery: {source: dns, dns: {name: vllm.test, nameservers: [%s]}%s}\n"

REFUSED = {
    # a nameserver port that is not a number: serve crashed at start with a traceback
    "nameserver-port": (DNS % ('"127.0.0.1:abc"', ""), "discovery.dns.nameservers"),
    # a host name: dnspython queries addresses only, every resolution timed out
    "nameserver-name": (DNS % ('"kube-dns"', ""), "not an IP address"),
    # the template made no valid backend: every endpoint "not added", forever
    "template-url": (DNS % ('"127.0.0.1"', ', template: {gpu_metrics_url: "x {host}"}'),
                     "template.gpu_metrics_url"),
    "template-node-dns": (
        DNS % ('"127.0.0.1"', ', template: {gpu_metrics_url: "http://{node}:9400/"}'),
        "DNS records name no node"),
    "template-control-node-dns": (
        DNS % ('"127.0.0.1"', ', template: {gpu_control_url: "http://{node}:9401"}'),
        "template.gpu_control_url: DNS records name no node"),
    "template-power-domain": (DNS % ('"127.0.0.1"', ", template: {power_domain: rack9}"),
                              "power_domain 'rack9'"),
    "template-key-env": (DNS % ('"127.0.0.1"', ", template: {api_key_env: GW_TEST_UNSET}"),
                         "discovery.template.api_key_env: GW_TEST_UNSET is not set"),
    # a kubeconfig that is not there: an endless outage saying "Expected key current-context"
    "kubeconfig": ("discovery: {source: kubernetes, kubernetes: {kubeconfig: /nope/kc}}\n",
                   "discovery.kubernetes.kubeconfig: /nope/kc: no such file"),
    "hook-kubeconfig": ("backends: [{id: a, url: 'http://127.0.0.1:9', pod: vllm-a}]\n"
                        "lifecycle: {restart_hook: {delete_pod: true, kubeconfig: /nope/kc}}\n",
                        "lifecycle.restart_hook.kubeconfig: /nope/kc: no such file"),
    # no credentials at all (not in a pod, no ~/.kube/config)
    "no-credentials": ("discovery: {source: kubernetes}\n", "no Kubernetes credentials"),
    # the source forgotten: "no backends configured" said nothing of it
    "block-without-source": ("discovery: {dns: {name: vllm.test}}\n", "add 'source: dns'"),
}



def kube_replica(made: list[GatewayThread], kubeconfig: str, redis_url: str, i: int,
                 **coordination: Any) -> GatewayThread:
    """Fleet-mode replica ``r{i}`` discovering through the API double (no node watch),
    started (not waited for) and added to ``made``."""
    cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
        "kubeconfig": kubeconfig, "namespace": "default", "retry_s": 0.2,
        "watch_nodes": False}},
        coordination={"redis_url": redis_url, "replica_id": f"r{i}", "sync_interval_s": 0.1,
                      **coordination})
    gw = GatewayThread(cfg)
    made.append(gw)
    gw.start(wait_ready=False)
    return gw


def warm(gw: GatewayThread) -> set[str]:
    """Backends ``gw`` has warm."""
    return {i for i, x in backends(gw).items() if x["state"] == "warm"}

@pytest.mark.parametrize("case", sorted(REFUSED))
def test_check_config_and_serve_refuse_a_discovery_config_they_cannot_use(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text, said = REFUSED[case]
    monkeypatch.delenv("GW_TEST_UNSET", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    f = tmp_path / "gw.yaml"
    f.write_text("server: {port: 1}\n" + text)  # never listens: refused before
    for command in ("check-config", "serve"):
        assert main([command, "-c", str(f)]) == 2, command
        err = capsys.readouterr().err
        assert said in err, (command, err)
        assert "Traceback" not in err


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


def kube_gateway(kube: KubeApiDouble, tmp_path: Path, **sections: object) -> GatewayThread:
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
        "kubeconfig": kubeconfig, "namespace": "default", "port_name": "http",
        "retry_s": 0.2, "watch_nodes": False}}, **sections)
    return GatewayThread(cfg)


def state(gw: GatewayThread, backend: str) -> str:
    return str(backends(gw)[backend]["state"])


def test_a_leaving_backend_cannot_be_undrained_and_stays_out_when_its_hold_ends(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path
) -> None:
    """a terminates (still serving): the operator's undrain is refused, 409 in the OpenAI
    error shape, and it stays draining. b is preempted (hold 1 s), then terminates: once
    its preemption hold ends, its passing probes must not bring it back into rotation."""
    a, b, c = pods("127.0.0.2"), pods("127.0.0.3"), pods("127.0.0.4")
    ports = [{"name": "http", "port": a.port}]

    def slice_(**terminating: bool) -> None:
        kube.put_slice("vllm-x", [
            endpoint(p.host, pod=n, ready=not terminating.get(n, False),
                     serving=True, terminating=terminating.get(n, False))
            for p, n in ((a, "vllm-a"), (b, "vllm-b"), (c, "vllm-c"))], ports=ports)

    slice_()
    gw = kube_gateway(kube, tmp_path, lifecycle={"preempt_hold_s": 1.0})
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: all(state(gw, i) == "warm"
                                    for i in ("vllm-a", "vllm-b", "vllm-c")), 30), backends(gw)

        slice_(**{"vllm-a": True})
        assert wait_for(lambda: state(gw, "vllm-a") == "draining", 10)
        r = httpx.post(f"{gw.url}/admin/backends/vllm-a/undrain", timeout=5)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "backend_leaving" and set(err) >= {"message", "type", "param"}
        assert "endpoint_terminating" in err["message"]
        time.sleep(0.5)
        assert state(gw, "vllm-a") == "draining"

        r = httpx.post(f"{gw.url}/admin/backends/vllm-b/preempt", timeout=5)
        assert r.status_code == 202, r.text
        assert wait_for(lambda: state(gw, "vllm-b") == "cold", 10)
        slice_(**{"vllm-a": True, "vllm-b": True})
        assert wait_for(lambda: admin(gw.url, "vllm-b")["hold"] == "leaving", 15), \
            admin(gw.url, "vllm-b")  # the preemption's hold passed: discovery's holds it
        served_a, served_b = chats(a), chats(b)
        for _ in range(20):
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        assert state(gw, "vllm-b") != "warm", admin(gw.url, "vllm-b")
        assert (chats(a), chats(b)) == (served_a, served_b), "a leaving pod got requests"
    finally:
        gw.stop()


def test_an_api_refusal_says_why_in_ready_and_in_the_hooks_error(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path
) -> None:
    """Without RBAC for EndpointSlices the API server explains (the service account, the
    verb, the resource): ``/ready``'s discovery check says it. A pod the API does not
    know: the restart hook's error names it."""
    kube.forbidden.add("endpointslices")
    gw = kube_gateway(kube, tmp_path)
    try:
        gw.start(wait_ready=False)

        def detail() -> str:
            return str(httpx.get(gw.url + "/ready", timeout=5).json()["checks"]
                       ["discovery"]["detail"])

        assert wait_for(lambda: "403" in detail(), 15), detail()
        assert 'cannot list resource "endpointslices"' in detail(), detail()
    finally:
        gw.stop()

    a, b = pods("127.0.0.2"), pods("127.0.0.3")  # two: a cycle never takes the last one
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config(
        [{"id": "a", "url": a.url, "pod": "vllm-gone", "namespace": "llm"},
         {"id": "b", "url": b.url}],
        lifecycle={"long": {"every_s": 2.0}, "check_interval_s": 0.1,
                   "restart_hook": {"delete_pod": True, "kubeconfig": kubeconfig,
                                    "timeout_s": 10}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: "vllm-gone" in (admin(gw.url, "a")["last_error"] or ""), 20)
        assert 'pods "vllm-gone" not found' in admin(gw.url, "a")["last_error"]
    finally:
        gw.stop()


def test_an_endpoint_without_a_node_is_served_without_gpu_telemetry(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path
) -> None:
    """The template's ``gpu_metrics_url`` names ``{node}``; one endpoint has no
    ``nodeName`` (optional in the EndpointSlice API): it is added and served, only its
    GPU is not monitored."""
    a, b = pods("127.0.0.2"), pods("127.0.0.3")
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a", node="127.0.0.2"),
                              endpoint(b.host, pod="vllm-b")],
                   ports=[{"name": "http", "port": a.port}])
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config([], discovery={
        "source": "kubernetes",
        "kubernetes": {"kubeconfig": kubeconfig, "namespace": "default",
                       "retry_s": 0.2, "watch_nodes": False},
        "template": {"gpu_metrics_url": f"http://{{node}}:{a.port}/gpu/metrics"}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: {i for i, x in backends(gw).items() if x["state"] == "warm"}
                        == {"vllm-a", "vllm-b"}, 30), backends(gw)
        assert admin(gw.url, "vllm-b")["gpu"]["monitored"] is False
        assert admin(gw.url, "vllm-a")["gpu"]["monitored"] is True
    finally:
        gw.stop()


def test_fleet_mode_a_pod_discovered_again_starts_afresh_on_every_replica(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path, redis_server: RedisServer
) -> None:
    """Fleet mode (real Redis), two replicas discovering the same pods: the operator
    drains vllm-a; its pod goes and comes back under the same name (a StatefulSet's) at
    another address: a new backend, warm on both replicas, as in the one-process gateway.
    A third replica started then must see it the same (it applied the old drain, a
    standing order in the store for a backend that is no longer there)."""
    a, a2, b = pods("127.0.0.2"), pods("127.0.0.5"), pods("127.0.0.3")
    ports = [{"name": "http", "port": a.port}]
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a"), endpoint(b.host, pod="vllm-b")],
                   ports=ports)
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    made: list[GatewayThread] = []

    def replica(i: int) -> GatewayThread:
        return kube_replica(made, kubeconfig, redis_server.url, i)

    try:
        r1, r2 = replica(1), replica(2)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: warm(gw) == {"vllm-a", "vllm-b"}, 30), backends(gw)
        r = httpx.post(f"{r1.url}/admin/backends/vllm-a/drain", timeout=5)
        assert r.status_code == 202, r.text
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: admin(gw.url, "vllm-a")["hold"] == "admin_drain", 10)

        kube.put_slice("vllm-x", [endpoint(b.host, pod="vllm-b")], ports=ports)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: "vllm-a" not in backends(gw), 15), backends(gw)
        kube.put_slice("vllm-x", [endpoint(a2.host, pod="vllm-a"), endpoint(b.host, pod="vllm-b")],
                       ports=ports)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: warm(gw) == {"vllm-a", "vllm-b"}, 30), backends(gw)

        r3 = replica(3)
        assert wait_for(lambda: "vllm-a" in backends(r3) and backends(r3)["vllm-a"]["state"]
                        in ("warm", "draining"), 30), backends(r3)
        assert wait_for(lambda: warm(r3) == {"vllm-a", "vllm-b"}, 30), backends(r3)
        assert admin(r3.url, "vllm-a")["hold"] is None
    finally:
        for gw in made:
            gw.stop()


def test_a_selector_or_port_name_that_matches_nothing_is_said(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Service always has an EndpointSlice, even without pods: none matching the selector
    is a mistyped selector or namespace, and the log says so (the fleet stays empty, and
    before only ``/ready``'s "0 endpoints" hinted at it). A slice without the configured
    ``port_name``: said too, naming the slice."""
    a = pods("127.0.0.2")
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a")],
                   ports=[{"name": "metrics", "port": a.port}],
                   labels={"app.kubernetes.io/name": "vllm"})
    caplog.set_level("WARNING", logger="gateway.discovery")
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    for selector, said in (("app.kubernetes.io/name=vlm", "no EndpointSlice in namespace "
                            "default matches label_selector 'app.kubernetes.io/name=vlm'"),
                           ("app.kubernetes.io/name=vllm", "EndpointSlices vllm-x have no "
                            "port named 'http'")):
        cfg = gateway_config([], discovery={"source": "kubernetes", "kubernetes": {
            "kubeconfig": kubeconfig, "namespace": "default", "label_selector": selector,
            "port_name": "http", "retry_s": 0.2, "watch_nodes": False}})
        gw = GatewayThread(cfg)
        try:
            gw.start(wait_ready=False)
            assert wait_for(lambda said=said: said in caplog.text, 15), caplog.text[-2000:]
            assert backends(gw) == {}
        finally:
            gw.stop()


def test_a_discovered_endpoint_at_a_static_backends_url_is_ignored(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path
) -> None:
    """The same server listed under ``backends:`` and discovered: one backend, not two
    (two ids for one server: a cycle drains one while the other still sends it requests,
    and its load counts twice). The other endpoint is added as usual."""
    a, b = pods("127.0.0.2"), pods("127.0.0.3")
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a"), endpoint(b.host, pod="vllm-b")],
                   ports=[{"name": "http", "port": a.port}])
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config([{"id": "static-a", "url": a.url}], discovery={
        "source": "kubernetes", "kubernetes": {"kubeconfig": kubeconfig,
                                               "namespace": "default", "retry_s": 0.2,
                                               "watch_nodes": False}})
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: "vllm-b" in backends(gw), 20), backends(gw)
        time.sleep(0.5)
        assert set(backends(gw)) == {"static-a", "vllm-b"}
    finally:
        gw.stop()


def test_fleet_mode_a_pod_removed_during_its_cycle_gives_its_lease_back(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path, redis_server: RedisServer
) -> None:
    """Fleet mode, two replicas: vllm-a rests in an operator's cooldown (a long rest) under
    r1's maintenance lease, followed out of rotation by r2. Its pod goes (the cycle is
    cancelled with the backend) and comes back under the same name: the old lease must
    not outlive it (r1 renewed it forever, so r2 held the new vllm-a out for good)."""
    a, a2, b = pods("127.0.0.2"), pods("127.0.0.5"), pods("127.0.0.3")
    ports = [{"name": "http", "port": a.port}]
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a"), endpoint(b.host, pod="vllm-b")],
                   ports=ports)
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    made: list[GatewayThread] = []

    def replica(i: int) -> GatewayThread:
        return kube_replica(made, kubeconfig, redis_server.url, i, lease_ttl_s=2.0)

    def leases(gw: GatewayThread) -> list[str]:
        fleet = httpx.get(gw.url + "/admin/fleet", timeout=5).json()
        return [str(x["backend"]) for x in fleet["leases"]]

    try:
        r1, r2 = replica(1), replica(2)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: warm(gw) == {"vllm-a", "vllm-b"}, 30), backends(gw)
        r = httpx.post(f"{r1.url}/admin/backends/vllm-a/cooldown", timeout=10,
                       json={"min_rest_s": 300, "force": True})
        assert r.status_code == 202, r.text
        assert wait_for(lambda: "vllm-a" in leases(r1), 10)
        assert wait_for(lambda: "vllm-a" not in warm(r2), 10), backends(r2)

        kube.put_slice("vllm-x", [endpoint(b.host, pod="vllm-b")], ports=ports)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: "vllm-a" not in backends(gw), 15), backends(gw)
        kube.put_slice("vllm-x", [endpoint(a2.host, pod="vllm-a"), endpoint(b.host, pod="vllm-b")],
                       ports=ports)
        for gw in (r1, r2):
            assert wait_for(lambda gw=gw: warm(gw) == {"vllm-a", "vllm-b"}, 30), backends(gw)
        assert wait_for(lambda: leases(r1) == [], 10), leases(r1)
    finally:
        for gw in made:
            gw.stop()
