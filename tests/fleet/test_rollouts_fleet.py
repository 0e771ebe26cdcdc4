"""A canary rollout from a config change in fleet mode (issue 18): two gateway replicas on
one Redis, a config with a slower canary (TTFT x1.5) posted to one of them reaches both;
each replica runs the rollout on its own traffic, and the rollback returns the fleet's
config (every replica back to the config without the rollout, the baseline serving
everything), with no failed request."""

from __future__ import annotations

from typing import Any

import httpx
import yaml

from tests.support.rollout_traffic import (
    FAST_STEPS,
    Servers,
    Traffic,
    config,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread


def _rollouts(gw: GatewayThread) -> list[dict[str, Any]]:
    return httpx.get(gw.url + "/admin/rollouts", timeout=10).json()["data"]  # type: ignore[no-any-return]

def _replicas(servers: Servers, redis_url: str, made: list[GatewayThread]) -> None:
    """Start replicas ``r1`` and ``r2`` over ``servers`` on one Redis (appended to ``made``
    as they start, so the caller stops every one that started)."""
    for rid in ("r1", "r2"):
        coord = {"redis_url": redis_url, "replica_id": rid, "sync_interval_s": 0.1}
        gw = GatewayThread(config(servers.backends, coordination=coord))
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=30)


def _post_with_rollout(gw: GatewayThread, plan: dict[str, Any]) -> httpx.Response:
    """``POST /admin/config`` to ``gw``: its own running config with ``rollouts: [plan]``
    (YAML); asserts a 200."""
    data = gw.gateway.cfg.model_dump(mode="json")
    data["rollouts"] = [plan]
    r = httpx.post(gw.url + "/admin/config", content=yaml.safe_dump(data).encode(),
                   headers={"content-type": "application/yaml"}, timeout=10)
    assert r.status_code == 200, r.text
    return r



def test_a_config_rollout_reaches_every_replica_and_its_rollback_returns_the_fleet(
    servers: Servers, redis_server: Any,
) -> None:
    for name in ("a1", "a2", "a3"):
        servers.add(name, "v1")
    servers.add("b", "v2", ttft_factor=1.5)
    made: list[GatewayThread] = []
    try:
        _replicas(servers, redis_server.url, made)
        r1, r2 = made
        plan = {"model": "m1", "baseline": "v1", "canary": "v2", "steps": [0.25, 1.0],
                **FAST_STEPS, "calibration": {"measure": "off"}}
        _post_with_rollout(r1, plan)
        assert wait_for(lambda: all(_rollouts(gw) for gw in made), 10)  # both run it
        traffic = [Traffic(gw.url, clients=3) for gw in made]
        try:
            assert wait_for(lambda: all(gw.gateway.cfg.rollouts == [] for gw in made), 60)
        finally:
            for t in traffic:
                t.stop()
        assert [t.failures for t in traffic] == [[], []]
        for gw in made:  # ended on both: rolled back, on TTFT or by the fleet's return
            (snap,) = _rollouts(gw)
            assert snap["status"] == "rolled_back", snap["history"]
        h = httpx.get(r2.url + "/admin/config/history", timeout=10).json()
        assert h["data"][0]["source"] in ("rollback", "fleet"), h["data"][0]
        after = Traffic(r2.url, clients=2)
        assert wait_for(lambda: len(after.versions) >= 10, 10)
        after.stop()
        assert after.failures == []
        assert {servers.version_of[fp] for fp in after.versions} == {"v1"}
    finally:
        for gw in made:
            gw.stop()


def test_a_canary_that_failed_on_one_replica_is_started_again_on_none(
    servers: Servers, redis_server: Any,
) -> None:
    """Traffic only through r1: r1's rollout fails (calibration), r2's cannot decide. The
    fleet's config returns; the same config posted again (to r2) starts the canary on no
    replica: r1 recorded the failure, r2 took it from the returned config's
    ``rollout_failed``."""
    servers.add("a", "v1")
    servers.add("b", "v2", drift=0.5)
    made: list[GatewayThread] = []
    try:
        _replicas(servers, redis_server.url, made)
        r1, r2 = made
        plan = {"model": "m1", "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
                **FAST_STEPS, "calibration": {"interval_s": 0.1, "min_probes": 3}}
        _post_with_rollout(r1, plan)
        assert wait_for(lambda: all(_rollouts(gw) for gw in made), 10)  # both run it
        traffic = Traffic(r1.url, clients=4)
        try:
            assert wait_for(lambda: all(gw.gateway.cfg.rollouts == [] for gw in made), 60)
        finally:
            traffic.stop()
        assert traffic.failures == []
        r = _post_with_rollout(r2, plan)  # r2's own coordination section
        (item,) = r.json()["rollouts"]
        assert not item["started"] and item["code"] == "rolled_back", item
        assert wait_for(lambda: all(gw.gateway.cfg.rollouts for gw in made), 10)
        for gw in made:
            (snap,) = _rollouts(gw)
            assert snap["status"] == "rolled_back", snap
            ended = httpx.get(gw.url + "/admin/rollouts", timeout=10).json()["ended"]
            assert any(e["blocking"] and e["canary"] == "v2" for e in ended), ended
    finally:
        for gw in made:
            gw.stop()
