"""Operator actions and verdicts are fleet-wide (issue 14, item 2; item 7's admin 503).

Three gateway replicas share a real Redis in front of simulated backends that record every
request they receive (``/sim/stats``: its headers, with the ``x-request-id`` naming the
replica it came through, and its arrival time), so what reached a backend is the
simulator's own account, not the gateway's."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import MODEL, Sim, admin, metric, metric_samples, post_admin
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

FAST = {"drain_deadline_s": 2.0}


class Load:
    """Steady load through ``gateways`` (one thread each, requests back to back), each
    request's ``x-request-id`` ``<name>-<n>``; ``failures`` lists what did not answer 200."""

    def __init__(self, gateways: dict[str, GatewayThread]) -> None:
        self.failures: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(name, gw.url), daemon=True)
            for name, gw in gateways.items()
        ]
        for t in self._threads:
            t.start()

    def _run(self, name: str, url: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        with httpx.Client(timeout=30) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    r = c.post(url + "/v1/chat/completions", json=body,
                               headers={"x-request-id": f"{name}-{n}"})
                    if r.status_code != 200:
                        self.failures.append(f"{name}-{n}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{name}-{n}: {type(e).__name__}: {e}")
                self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def arrivals(sim: Sim, *prefixes: str) -> list[tuple[float, str]]:
    """(arrival unix time, request id) of the generation requests ``sim`` received through
    the replicas named by ``prefixes``."""
    out = []
    for r in sim.stats()["recent_requests"]:
        rid = r["headers"].get("x-request-id", "")
        if rid.split("-", 1)[0] in prefixes:
            out.append((float(r["at"]), rid))
    return out


def shown(gw: GatewayThread, backend: str) -> dict[str, Any]:
    return admin(gw.url, backend)  # type: ignore[no-any-return]


def test_drain_sent_to_one_replica_stops_every_replica_sending_to_it_within_1s(
    sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b, c = sims("a"), sims("b"), sims("c")
    r1, r2, r3 = replicas(3, {"a": a.url, "b": b.url, "c": c.url}, lifecycle=FAST)
    load = Load({"r2": r2, "r3": r3})
    try:
        # the load reaches a through both other replicas before the drain (else the test
        # below could not fail)
        assert wait_for(lambda: {rid.split("-")[0] for _, rid in arrivals(a, "r2", "r3")}
                        == {"r2", "r3"}, timeout=15)
        r = post_admin(r1.url, "a", "drain", {"deadline_s": 5})
        answered = time.time()
        assert r.status_code == 202, r.text
        time.sleep(3.0)  # steady load through r2 and r3 meanwhile
        late = [(round(t - answered, 2), rid) for t, rid in arrivals(a, "r2", "r3")
                if t > answered + 1.0]
        assert late == [], f"reached a more than 1 s after the drain: {late[:5]}"
        fleet = r.json()["fleet"]
        assert fleet["accepted"] == "fleet-wide" and fleet["by"] == "r1"
        assert fleet["replicas"] == ["r1", "r2", "r3"]
        # the others kept serving the load meanwhile
        after = [rid for s in (b, c) for t, rid in arrivals(s, "r2", "r3") if t > answered + 1]
        assert len(after) >= 4
        for gw in (r1, r2, r3):
            seen = shown(gw, "a")
            assert seen["hold"] == "admin_drain" and seen["state"] in ("draining", "cooldown")

        # undrain sent to replica 3 returns a on every replica
        r = post_admin(r3.url, "a", "undrain")
        undrained = time.time()
        assert r.status_code == 200, r.text
        assert r.json()["fleet"]["accepted"] == "fleet-wide"
        for gw in (r1, r2, r3):
            assert wait_for(lambda gw=gw: shown(gw, "a")["state"] == "warm"
                            and shown(gw, "a")["hold"] is None, timeout=5)
        assert wait_for(lambda: {rid.split("-")[0] for t, rid in arrivals(a, "r2", "r3")
                                 if t > undrained} == {"r2", "r3"}, timeout=15)
    finally:
        load.stop()
    assert load.failures == []
    m = metric_samples(r2.url)
    assert metric(m, "gateway_fleet_operator_actions_total", action="drain",
                  origin="applied") == 1.0


def test_admin_writes_answer_503_while_the_store_is_down_and_change_nothing(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b = sims("a"), sims("b")
    gws = replicas(3, {"a": a.url, "b": b.url}, lifecycle=FAST)
    redis_server.stop()
    assert wait_for(lambda: all(gw.gateway.coord.link.fallback for gw in gws), timeout=10)
    for action, body in (("drain", None), ("preempt", {"deadline_s": 1}), ("undrain", None),
                         ("cooldown", {"force": True})):
        r = post_admin(gws[0].url, "a", action, body)
        assert r.status_code == 503, (action, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "coordination_unavailable" and err["type"] == "server_error"
        assert "nothing changed on any replica" in err["message"]
        assert "does not answer" in err["message"]  # the link's reason
        assert int(r.headers["retry-after"]) >= 1
    time.sleep(0.5)  # a wrongly applied action would have moved by now
    for gw in gws:
        for bid in ("a", "b"):
            seen = shown(gw, bid)  # reads keep working
            assert (seen["state"], seen["hold"], seen["drained"]) == ("warm", None, False)
    # the store answers again: writes go through, to every replica
    redis_server.start()
    assert wait_for(lambda: all(gw.gateway.coord.link.up for gw in gws), timeout=10)
    assert post_admin(gws[1].url, "b", "drain").status_code == 202
    for gw in gws:
        assert wait_for(lambda gw=gw: shown(gw, "b")["hold"] == "admin_drain", timeout=5)


def test_standing_drain_survives_a_redis_restart_and_reaches_a_replica_started_later(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b = sims("a"), sims("b")
    urls = {"a": a.url, "b": b.url}
    r1, r2 = replicas(2, urls, lifecycle=FAST)
    assert post_admin(r2.url, "a", "drain").status_code == 202
    assert wait_for(lambda: shown(r1, "a")["hold"] == "admin_drain", timeout=5)
    redis_server.stop()
    assert wait_for(lambda: r1.gateway.coord.link.fallback and r2.gateway.coord.link.fallback,
                    timeout=10)
    redis_server.start()  # empty: the replicas write back the drain they hold
    assert wait_for(lambda: r1.gateway.coord.link.up and r2.gateway.coord.link.up, timeout=10)
    (r3,) = replicas(1, urls, wait_routable=1, coordination={"replica_id": "r3"},
                     lifecycle=FAST)
    assert wait_for(lambda: shown(r3, "a")["hold"] == "admin_drain", timeout=5)
    assert shown(r3, "b")["state"] == "warm"


@pytest.fixture
def gpu_replicas(redis_server: Any) -> Any:
    """Factory ``gpu_replicas(n, [backend dicts], **sections)``: like the ``replicas``
    fixture, with each backend's own fields (a ``gpu_metrics_url`` on some only)."""
    made: list[GatewayThread] = []

    def make(n: int, backends: list[dict[str, Any]], **sections: Any) -> list[GatewayThread]:
        for i in range(1, n + 1):
            coord = {"redis_url": redis_server.url, "replica_id": f"r{i}",
                     "sync_interval_s": 0.1}
            gw = GatewayThread(gateway_config(backends, coordination=coord, **sections))
            made.append(gw)
            gw.start(wait_ready=False)
        for gw in made:
            gw.wait_ready(timeout=30, routable=len(backends))
        return made

    yield make
    for gw in made:
        gw.stop()


GPU = {"tick_s": 0.1}
THERMAL = {"scrape_interval_s": 0.1, "scrape_timeout_s": 1.0, "stale_after_s": 2.0}


def test_gpu_fault_seen_by_every_replica_runs_the_restart_hook_once_and_holds_it_everywhere(
    tmp_path: Path, sims: Callable[..., Sim], gpu_replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b = sims("a", gpu=GPU), sims("b")
    out = tmp_path / "hook.log"
    code = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')"
    hook = {"command": [sys.executable, "-c", code, str(out), "{backend_id}"]}
    backends = [{"id": "a", "url": a.url, "gpu_metrics_url": f"{a.url}/gpu/metrics"},
                {"id": "b", "url": b.url}]
    gws = gpu_replicas(3, backends, lifecycle={**FAST, "restart_hook": hook}, thermal=THERMAL)
    # every replica scrapes a's GPUs (the simulator's DCGM page)
    for gw in gws:
        assert gw.gateway.controller.gpu.monitored
        assert wait_for(lambda gw=gw: shown(gw, "a")["gpu"]["tier"] != "unknown", timeout=10)
    r = httpx.patch(f"{a.url}/sim/faults", json={"ecc_dbe_errors": 1})
    assert r.status_code == 200
    for gw in gws:
        assert wait_for(lambda gw=gw: shown(gw, "a")["state"] == "unhealthy", timeout=10)
    assert wait_for(out.exists, timeout=10)
    time.sleep(2.0)  # every replica has seen the fault by now (20 GPU scrapes each)
    assert out.read_text().splitlines() == ["a"], "the restart hook ran more than once"
    ran = [metric(metric_samples(gw.url), "gateway_restart_hooks_total", backend="a",
                  result="ok") or 0.0 for gw in gws]
    assert sum(ran) == 1.0
    for gw in gws:  # the winner's restarting hold, on every replica
        assert wait_for(lambda gw=gw: shown(gw, "a")["hold"] == "restarting", timeout=5)
        assert shown(gw, "b")["state"] == "warm"
    # an operator's undrain on one replica releases it everywhere
    assert post_admin(gws[2].url, "a", "undrain").status_code == 200
    for gw in gws:
        assert wait_for(lambda gw=gw: shown(gw, "a")["hold"] is None, timeout=5)


def test_preemption_sent_to_one_replica_takes_the_backend_cold_on_every_replica(
    sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b = sims("a"), sims("b")
    gws = replicas(3, {"a": a.url, "b": b.url}, lifecycle=FAST)
    r = post_admin(gws[1].url, "a", "preempt", {"deadline_s": 1})
    assert r.status_code == 202, r.text
    for gw in gws:
        assert wait_for(lambda gw=gw: shown(gw, "a")["hold"] == "preempted"
                        and shown(gw, "a")["state"] == "cold", timeout=5)
    fleet = r.json()["fleet"]
    assert fleet["action"] == "preempt" and abs(fleet["deadline_at"] - fleet["at"] - 1) < 1e-3
    # a cooldown refused on a backend that is out: 409 saying why, in OpenAI's shape
    r = post_admin(gws[0].url, "a", "cooldown")
    assert r.status_code == 409
    assert r.json()["error"]["message"].endswith("it is cold, not warm.")


def test_every_replica_keeps_the_fleets_calibration_baseline(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    import json

    import redis

    a = sims("a")
    (r1,) = replicas(1, {"a": a.url}, calibration={"enabled": True})
    own = r1.gateway.fleet.get("a").calibration_baseline
    assert own  # r1 took it from a's answers and offered it first
    key = f"{r1.gateway.cfg.coordination.namespace}:ops:baselines"
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        raw = store.hget(key, "a")
        assert raw is not None, "no baseline for the fleet in the store"
        stored = json.loads(raw)
        assert stored["answers"] == own
        # as if another replica had offered a different one first
        fleet = {p: f"fleet answer {i}" for i, p in enumerate(own)}
        store.hset(key, "a", json.dumps({**stored, "answers": fleet}))
    finally:
        store.close()
    (r2,) = replicas(1, {"a": a.url}, coordination={"replica_id": "r2"},
                     calibration={"enabled": True})
    assert r2.gateway.fleet.get("a").calibration_baseline == fleet


def test_gpu_fault_while_the_store_is_down_restarts_locally_and_is_shared_when_it_is_back(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    a, b = sims("a"), sims("b")
    r1, r2 = replicas(2, {"a": a.url, "b": b.url}, lifecycle=FAST)
    redis_server.stop()
    assert wait_for(lambda: r1.gateway.coord.link.fallback, timeout=10)
    ops = r1.gateway.coord.operator
    backend = r1.gateway.fleet.get("a")

    async def fault() -> bool:
        r1.gateway.controller.drains.hold_for_gpu_fault(backend, "gpu_ecc")
        return await ops.claim_gpu_restart(backend, "gpu_ecc")

    assert r1.run(fault()) is True  # no store to claim from: the hook runs here
    assert shown(r1, "a")["hold"] == "gpu_fault" and shown(r2, "a")["hold"] is None
    redis_server.start()  # empty: r1 writes back the hold it knows
    assert wait_for(lambda: shown(r2, "a")["hold"] == "gpu_fault", timeout=10)
    assert shown(r2, "a")["state"] == "unhealthy"
