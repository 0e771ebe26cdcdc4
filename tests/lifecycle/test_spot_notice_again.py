"""A spot notice for a node that was noticed before, after an operator undrained its backend
(issue 15, item 2): the node is still going away, so its backend is preempted again, while
the notice is not counted twice and the zone's score does not drop twice. The real gateway
under uvicorn in front of simulated vLLM backends; the admin API through real HTTP.

Zone a: spot ``a1`` on node n1 and on-demand ``a2``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.lifecycle.support import Sim, admin, chat_body, metric, metric_samples, post_admin
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


@pytest.fixture
def zone_a(sims: Callable[..., Sim]) -> Iterator[tuple[GatewayThread, dict[str, Sim]]]:
    backends = {k: sims(k, itl_s=0.005) for k in ("a1", "a2")}
    entries = [
        {"id": "a1", "url": backends["a1"].url, "zone": "a", "capacity_type": "spot",
         "node": "n1", "instance_type": "g6.xlarge"},
        {"id": "a2", "url": backends["a2"].url, "zone": "a", "capacity_type": "on-demand",
         "node": "n2"},
    ]
    gw = GatewayThread(gateway_config(entries, spot={"half_life_s": 1e6}))
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=30, routable=2)
        yield gw, backends
    finally:
        gw.stop()


def notice(gw: GatewayThread, node: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/admin/zones/a/notice", json={"node": node}, timeout=10)


def test_a_notice_again_after_an_undrain_preempts_the_node_again_without_counting_twice(
    zone_a: tuple[GatewayThread, dict[str, Sim]],
) -> None:
    gw, sims = zone_a
    first = notice(gw, "n1")
    assert first.status_code == 202 and first.json()["preempted"] == ["a1"], first.text
    assert wait_for(lambda: admin(gw.url, "a1")["state"] == "cold", timeout=40)
    # the operator takes it back (a false alarm, they thought); it warms up and serves
    assert post_admin(gw.url, "a1", "undrain").status_code == 200
    assert wait_for(lambda: admin(gw.url, "a1")["state"] == "warm", timeout=30)
    assert admin(gw.url, "a1")["hold"] is None
    # the node's notice again (the provider's, or the node watch's): a1 goes out again
    again = notice(gw, "n1")
    assert again.status_code == 200, again.text
    body = again.json()
    assert body["repeat"] is True and body["preempted"] == ["a1"], body
    assert body["score"] == pytest.approx(0.5, abs=1e-3)  # not halved twice
    assert admin(gw.url, "a1")["hold"] == "preempted"
    assert wait_for(lambda: admin(gw.url, "a1")["state"] == "cold", timeout=40)
    m = metric_samples(gw.url)
    assert metric(m, "gateway_spot_interruptions_total", zone="a",
                  instance_type="g6.xlarge") == 1.0  # counted once
    # no new request reaches a1
    with httpx.Client(timeout=10) as c:
        for n in range(10):
            r = c.post(gw.url + "/v1/chat/completions", json=chat_body(max_tokens=2),
                       headers={"x-request-id": f"after-{n}"})
            assert r.status_code == 200, r.text
    late = [r for r in sims["a1"].stats()["recent_requests"]
            if r["headers"].get("x-request-id", "").startswith("after-")]
    assert late == []
    # and once more while it is still preempted: nothing to do
    third = notice(gw, "n1")
    assert third.status_code == 200 and third.json()["preempted"] == [], third.text


def test_a_notice_for_a_resting_backend_sends_it_cold_and_back_after_the_hold(
    sims: Callable[..., Sim],
) -> None:
    """A backend resting in a medium cycle (an admin's cooldown) when its node's notice
    comes: the cycle ends, then it is ``cold`` like every preempted backend, and once the
    preemption's hold is over (the instance stayed: a false alarm, a rebalance
    recommendation) its probes bring it back through warming. Before the fix it stayed in
    ``cooldown``, drained, for good: nothing brought it back but an operator."""
    backends = {k: sims(k, itl_s=0.005) for k in ("a1", "a2")}
    entries = [
        {"id": "a1", "url": backends["a1"].url, "zone": "a", "capacity_type": "spot",
         "node": "n1"},
        {"id": "a2", "url": backends["a2"].url, "zone": "a", "capacity_type": "on-demand",
         "node": "n2"},
    ]
    cfg = gateway_config(entries, lifecycle={"preempt_hold_s": 3, "medium": {"cooldown_s": 1}})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=30, routable=2)
        r = post_admin(gw.url, "a1", "cooldown", {"force": True, "min_rest_s": 2})
        assert r.status_code in (200, 202), r.text
        assert wait_for(lambda: admin(gw.url, "a1")["state"] == "cooldown", timeout=10)
        got = notice(gw, "n1")
        assert got.status_code == 202 and got.json()["preempted"] == ["a1"], got.text
        assert wait_for(lambda: admin(gw.url, "a1")["state"] == "cold", timeout=15), \
            admin(gw.url, "a1")
        # the hold (3 s) over and the instance still there: back through warming
        assert wait_for(lambda: admin(gw.url, "a1")["state"] == "warm", timeout=20), \
            admin(gw.url, "a1")
        a1 = admin(gw.url, "a1")
        assert a1["hold"] is None and a1["drained"] is False, a1
        states = [t["to"] for t in a1["history"]]
        assert states[-3:] == ["cold", "warming", "warm"], states
    finally:
        gw.stop()
