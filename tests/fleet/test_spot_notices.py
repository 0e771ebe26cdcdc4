"""Spot notices are fleet-wide (issue 15, item 2): a notice sent to one replica preempts the
node's backends on every replica, and each replica counts it once and drops its own copy of
the zone's score. Two gateway replicas share a real Redis in front of simulated backends,
which record every request they receive (``x-request-id`` naming the replica it came
through)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import Sim, admin, chat_body, metric, metric_samples
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

PLACES = {"a1": ("a", "spot", "n1"), "a2": ("a", "spot", "n2"), "b1": ("b", "on-demand", "n3")}


@pytest.fixture
def two(redis_server: Any, sims: Callable[..., Sim]) -> Iterator[tuple[list[GatewayThread],
                                                                       dict[str, Sim], Any]]:
    backends = {k: sims(k, itl_s=0.005) for k in PLACES}
    entries = [{"id": k, "url": s.url, "zone": PLACES[k][0], "capacity_type": PLACES[k][1],
                "node": PLACES[k][2], "instance_type": "m7i.large"} for k, s in backends.items()]
    gws = []
    try:
        for i in (1, 2):
            cfg = gateway_config(entries, spot={"half_life_s": 1e6}, coordination={
                "redis_url": redis_server.url, "replica_id": f"r{i}", "sync_interval_s": 0.1})
            gw = GatewayThread(cfg)
            gws.append(gw)
            gw.start(wait_ready=False)
        for gw in gws:
            gw.wait_ready(timeout=30, routable=len(backends))
        for gw in gws:  # each sees the other live: a notice then reaches both
            assert wait_for(lambda gw=gw: len(httpx.get(gw.url + "/admin/fleet", timeout=5)
                                                 .json()["replicas"]) == 2, timeout=10)
        yield gws, backends, redis_server
    finally:
        for gw in gws:
            gw.stop()


def score(gw: GatewayThread, zone: str) -> float:
    zones = httpx.get(gw.url + "/admin/zones", timeout=5).json()["zones"]
    return next(float(z["score"]) for z in zones if z["zone"] == zone)


def test_a_notice_sent_to_one_replica_preempts_and_counts_once_on_every_replica(
    two: tuple[list[GatewayThread], dict[str, Sim], Any],
) -> None:
    (r1, r2), sim, redis_server = two
    r = httpx.post(r1.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["preempted"] == ["a1"] and body["fleet"]["accepted"] == "fleet-wide"
    assert body["fleet"]["replicas"] == ["r1", "r2"]
    # r2 applies it within a sync round or two: a1 out, zone a's score halved
    assert wait_for(lambda: admin(r2.url, "a1")["hold"] == "preempted", timeout=5)
    assert admin(r2.url, "a1")["state"] in ("draining", "cold")
    assert wait_for(lambda: score(r2, "a") < 0.6, timeout=5)
    assert score(r2, "a") == pytest.approx(0.5, abs=1e-3)
    assert score(r1, "a") == pytest.approx(0.5, abs=1e-3) and score(r2, "b") == 1.0
    # no request through r2 reaches a1 any more
    with httpx.Client(timeout=10) as c:
        for n in range(12):
            got = c.post(r2.url + "/v1/chat/completions", json=chat_body(max_tokens=2),
                         headers={"x-request-id": f"r2late-{n}"})
            assert got.status_code == 200, got.text
    late = [r for r in sim["a1"].stats()["recent_requests"]
            if r["headers"].get("x-request-id", "").startswith("r2late-")]
    assert late == []
    time.sleep(0.5)  # several more sync rounds: each replica counted it once
    for gw in (r1, r2):
        m = metric_samples(gw.url)
        assert metric(m, "gateway_spot_interruptions_total", zone="a",
                      instance_type="m7i.large") == 1.0, gw.url
    # the same node again, now sent to r2: a repeat there, nothing more anywhere
    again = httpx.post(r2.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
    assert again.status_code == 200 and again.json()["repeat"] is True, again.text
    time.sleep(0.3)
    assert score(r1, "a") == pytest.approx(0.5, abs=1e-3)
    # store down: refused (503, OpenAI-shaped), nothing changes on any replica
    redis_server.stop()
    assert wait_for(lambda: r1.gateway.coord.link.fallback, timeout=10)
    down = httpx.post(r1.url + "/admin/zones/a/notice", json={"node": "n2"}, timeout=10)
    assert down.status_code == 503, down.text
    assert down.json()["error"]["code"] == "coordination_unavailable"
    assert admin(r1.url, "a2")["hold"] is None and score(r1, "a") == pytest.approx(0.5, abs=1e-3)


def test_a_notice_again_after_an_undrain_preempts_on_every_replica_without_counting_twice(
    two: tuple[list[GatewayThread], dict[str, Sim], Any],
) -> None:
    (r1, r2), _sim, _redis = two
    first = httpx.post(r1.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
    assert first.status_code == 202, first.text
    for gw in (r1, r2):
        assert wait_for(lambda gw=gw: admin(gw.url, "a1")["state"] == "cold", timeout=40)
    # an operator takes a1 back through r1: every replica undrains it
    assert httpx.post(r1.url + "/admin/backends/a1/undrain", timeout=10).status_code == 200
    for gw in (r1, r2):
        assert wait_for(lambda gw=gw: admin(gw.url, "a1")["state"] == "warm", timeout=30)
    # the node's notice again, now through r2: a1 goes out on every replica, counted once
    again = httpx.post(r2.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
    assert again.status_code == 200, again.text
    body = again.json()
    assert body["repeat"] is True and body["preempted"] == ["a1"], body
    assert body["fleet"]["accepted"] == "fleet-wide" and body["fleet"]["notice_id"] is None
    for gw in (r1, r2):
        assert wait_for(lambda gw=gw: admin(gw.url, "a1")["hold"] == "preempted", timeout=5)
    time.sleep(0.5)  # several sync rounds
    for gw in (r1, r2):
        assert score(gw, "a") == pytest.approx(0.5, abs=1e-3), gw.url
        m = metric_samples(gw.url)
        assert metric(m, "gateway_spot_interruptions_total", zone="a",
                      instance_type="m7i.large") == 1.0, gw.url
