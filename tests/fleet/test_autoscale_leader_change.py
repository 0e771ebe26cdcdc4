"""Fleet mode: a change of leader keeps the fleet's scale-down cooldown. Two gateway
replicas (the real app under uvicorn each) share a real Redis and one simulated vLLM; load
goes through the openai SDK.

``r2`` runs alone (so it leads) while load asks for several replicas, then the load stops:
``desired_replicas`` must hold for ``scale_down_cooldown_s``. ``r1`` then starts and, with
the lower id, takes the lead at once. Before this was fixed its first decisions knew only
the replicas that existed (one), so the fleet's answer fell from the held count to 1 a few
seconds after ``r1`` joined, long before the cooldown: the orchestrator would have removed
the replicas it had just been asked for. Now every replica keeps the leader's
recommendations in its own stabilization window, and a new leader publishes nothing before
it has read the fleet's record, so the answer holds until the cooldown passes, then falls.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.lifecycle.support import MODEL, Sim, wait_for
from tests.support.load import StreamLoad
from tests.support.servers import GatewayThread, gateway_config

COOLDOWN_S = 7.0  # r1 joins and takes the lead within its first 5 s


def answer(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/autoscale", params={"model": MODEL}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def replica(redis_url: str, rid: str, sim_url: str) -> GatewayThread:
    cfg = gateway_config(
        [{"id": "a", "url": sim_url, "max_num_seqs": 2}],
        coordination={"redis_url": redis_url, "replica_id": rid, "sync_interval_s": 0.1},
        admission={"in_flight_per_seq": 4}, slo={"ttft_s": 60},
        forecast={"enabled": False},  # only the fast paradigm moves: no warm pool to wait out
        autoscale={"interval_s": 0.2, "scale_down_cooldown_s": COOLDOWN_S},
    )
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    gw.wait_ready(timeout=30, routable=1)
    return gw


def test_a_new_leader_keeps_the_scale_down_cooldown(redis_server: Any) -> None:
    sim = Sim("a", 0.05, max_num_seqs=2)
    started: list[GatewayThread] = []
    try:
        r2 = replica(redis_server.url, "r2", sim.url)
        started.append(r2)
        load = StreamLoad(r2.url, workers=8)
        try:
            assert wait_for(lambda: answer(r2)["desired_replicas"] >= 3, 30), answer(r2)
        finally:
            load.stop()
        stopped = time.monotonic()
        held = answer(r2)["desired_replicas"]
        assert held >= 3 and answer(r2)["decided_by"] == "r2"

        r1 = replica(redis_server.url, "r1", sim.url)
        started.append(r1)
        # ready = the store answered it once; its next decision (every 0.2 s) is made on it
        time.sleep(0.5)
        led_by_r1: list[int] = []
        while time.monotonic() < stopped + COOLDOWN_S - 2:
            a1, a2 = answer(r1), answer(r2)
            for a in (a1, a2):  # whoever decides, the held count stands within the cooldown
                assert a["desired_replicas"] >= held, (a1, a2, held)
            if a2["decided_by"] == "r1":
                led_by_r1.append(a2["desired_replicas"])
            time.sleep(0.2)
        assert led_by_r1, "r1 never took the lead within the cooldown (slow start?)"
        # after the cooldown the answer falls: nothing sticks
        assert wait_for(lambda: answer(r2)["desired_replicas"] < held, COOLDOWN_S + 15), (
            answer(r2))
        assert answer(r2)["decided_by"] == answer(r1)["decided_by"] == "r1"
        assert load.failures == [], load.failures[:5]
    finally:
        for gw in started:
            gw.stop()
        sim.stop()
