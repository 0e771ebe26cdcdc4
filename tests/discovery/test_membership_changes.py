"""Membership changes while requests run, through the real gateway under uvicorn and
simulated vLLM servers, with the endpoint conditions only the Kubernetes source reports
(``serving``, ``terminating``).

The Kubernetes API server cannot run here: :class:`KubeApiStandIn` stands in for the
Kubernetes source at its protocol boundary, the :class:`~gateway.fleet.discovery.DiscoverySink`
interface (whole snapshots of endpoints with EndpointSlice conditions, nodes, spot notices),
called on the gateway's event loop as the real source calls it. Everything behind it is the
gateway's own: membership, drains, probes, warm-up, routing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from gateway.fleet.discovery import DiscoverySink, Endpoint, NodeInfo, SpotNotice
from tests.discovery.test_dns_discovery import Load, backends
from tests.lifecycle.support import Sim, metric, metric_samples, sdk, sdk_kwargs, wait_for
from tests.support.servers import GatewayThread, gateway_config


class KubeApiStandIn:
    """Stand-in for the Kubernetes source (the API server cannot run in a test): it keeps
    the sink it is run with and reports what the test tells it to, on the gateway's loop."""

    name = "kubernetes"

    def __init__(self) -> None:
        self.sink: DiscoverySink | None = None
        self.gw: GatewayThread | None = None

    async def run(self, sink: DiscoverySink) -> None:
        self.sink = sink
        await asyncio.Event().wait()

    def _call(self, fn: Callable[[DiscoverySink], None]) -> None:
        assert self.gw is not None and wait_for(lambda: self.sink is not None, 10)

        async def call() -> None:
            assert self.sink is not None
            fn(self.sink)

        self.gw.run(call())

    def endpoints(self, snapshot: Sequence[Endpoint]) -> None:
        self._call(lambda s: s.endpoints(snapshot))

    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        self._call(lambda s: s.nodes(nodes))

    def spot_notice(self, notice: SpotNotice) -> None:
        self._call(lambda s: s.spot_notice(notice))


def ep(pod: Sim, **conditions: Any) -> Endpoint:
    return Endpoint(id=f"pod-{pod.name}", url=pod.url, host=pod.host, **conditions)


def test_a_terminating_pod_is_drained_never_cut_and_returns_when_it_serves_again(
    pods: Callable[..., Sim],
) -> None:
    static = Sim("static")
    fast, slow = pods("127.0.0.2"), pods("127.0.0.3", itl_s=0.05)
    slow.name = "slow"
    api = KubeApiStandIn()
    # a drain deadline far shorter than the slow pod's streams (2 s): a terminating pod
    # that still serves must not be cut by it
    cfg = gateway_config(
        [{"id": "s1", "url": static.url}],
        discovery={"source": "kubernetes"},
        lifecycle={"drain_deadline_s": 0.5},
    )
    gw = GatewayThread(cfg, source=api)
    api.gw = gw
    notices: list[SpotNotice] = []
    try:
        gw.start(wait_ready=False)
        # not ready until the source has reported the fleet once (the discovery check)
        assert wait_for(lambda: "discovery" in httpx.get(gw.url + "/ready").json().get(
            "failing", []), 10)
        gw.gateway.controller.membership.on_spot_notice = notices.append
        # an endpoint with a static backend's id is ignored; the static one stays as it is
        api.endpoints([ep(fast), ep(slow), Endpoint(id="s1", url=fast.url, host=fast.host)])
        gw.wait_ready()
        ids = {"s1", "pod-127.0.0.2", "pod-slow"}
        assert wait_for(
            lambda: {i for i, b in backends(gw).items() if b["state"] == "warm"} == ids, 15
        ), backends(gw)
        assert backends(gw)["s1"]["url"] == static.url

        # long streams on the slow pod; then it says terminating (still serving)
        load = Load(gw.url, workers=6, max_tokens=40)
        try:
            assert wait_for(lambda: backends(gw)["pod-slow"]["in_flight"] >= 1, 15)
            api.endpoints([ep(fast), ep(slow, ready=False, terminating=True)])
            assert wait_for(lambda: backends(gw)["pod-slow"]["state"] == "draining", 5)
            # its streams (2 s each) finish there, uncut (the load checks each whole);
            # nothing new is sent (every attempt there counts in flight until it ends)
            assert wait_for(lambda: backends(gw)["pod-slow"]["in_flight"] == 0, 15)
            served = slow.chat_requests()
            before = load.ok
            assert wait_for(lambda: load.ok >= before + 10, 20)
            assert slow.chat_requests() == served, "a request reached a terminating pod"
            assert "pod-slow" in backends(gw)  # still in the snapshot: kept, drained

            # it serves again (its termination was called off): back in rotation
            api.endpoints([ep(fast), ep(slow)])
            assert wait_for(lambda: backends(gw)["pod-slow"]["state"] == "warm", 5)
            assert wait_for(lambda: slow.chat_requests() > served, 15)

            # terminating again, then gone from the snapshot: removed once nothing is in
            # flight there
            api.endpoints([ep(fast), ep(slow, ready=False, terminating=True)])
            assert wait_for(lambda: backends(gw)["pod-slow"]["in_flight"] == 0, 15)
            api.endpoints([ep(fast)])
            assert wait_for(lambda: "pod-slow" not in backends(gw), 20), backends(gw)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]

        # placement from the node watch; a spot notice reaches the spot handling
        api.nodes({"n1": NodeInfo("n1", zone="z1", capacity_type="spot", instance_type="g6")})
        api.endpoints([ep(fast, node="n1")])
        assert wait_for(lambda: gw.gateway.fleet.get("pod-127.0.0.2") is not None, 5)
        fleet_fast = gw.gateway.fleet.get("pod-127.0.0.2")
        assert fleet_fast is not None and fleet_fast.placement.zone == "z1"
        assert fleet_fast.placement.spot and fleet_fast.placement.instance_type == "g6"
        notice = SpotNotice(zone="z1", node="n1", reason="test")
        api.spot_notice(notice)
        assert notices == [notice]

        # every discovered pod gone: the static backend alone serves
        api.endpoints([])
        assert wait_for(lambda: set(backends(gw)) == {"s1"}, 10), backends(gw)
        answer = sdk(gw.url).chat.completions.create(**sdk_kwargs(4))
        assert answer.choices[0].finish_reason == "length"
        assert static.chat_requests() >= 1
        samples = metric_samples(gw.url)
        assert metric(samples, "gateway_discovery_changes_total", change="ignored") == 1
        assert metric(samples, "gateway_discovery_changes_total", change="rejoined") == 1
        assert metric(samples, "gateway_discovery_changes_total", change="removed") == 2
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'backend="pod-slow"' not in text
    finally:
        gw.stop()
        static.stop()
