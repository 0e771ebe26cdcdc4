"""Two replicas on one namespace whose configs disagree about the fleet (a backend id with
another URL, backends only one knows, another ``max_unavailable``): e.g. two unrelated fleets
on one Redis without their own ``coordination.namespace``. A drain of ``a`` through one would
take out a different server on the other, silently. Each replica now says so: a warning in
its log and ``config_differs`` on that replica's entry in ``/admin/fleet``."""

from __future__ import annotations

import logging

import httpx

from gateway.coord.replicas import config_differences
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def entry(url: str, rid: str) -> dict:
    """Replica ``rid``'s entry in ``url``'s ``/admin/fleet``; ``{}`` while that replica has
    not been seen yet (its first heartbeat) or ``url`` is not listening yet."""
    try:
        replicas = httpx.get(url + "/admin/fleet", timeout=5).json()["replicas"]
    except httpx.TransportError:
        return {}
    return next((r for r in replicas if r["id"] == rid), {})


def test_replicas_whose_configs_disagree_on_one_namespace_say_so(redis_server, sims, caplog):
    a, b, c = sims("A"), sims("B"), sims("C")
    caplog.set_level(logging.WARNING, logger="gateway.coord")
    made = []
    try:
        for rid, backends, mu in (("r1", {"a": a.url, "b": b.url}, 1), ("r2", {"a": c.url}, 2)):
            cfg = gateway_config(
                [{"id": k, "url": u} for k, u in backends.items()],
                coordination={"redis_url": redis_server.url, "replica_id": rid,
                              "sync_interval_s": 0.1},
                lifecycle={"max_unavailable": mu, "slow_start_s": 0,
                           "medium": {"every_s": 0, "every_requests": 0}},
            )
            gw = GatewayThread(cfg)
            gw.start(wait_ready=False)
            made.append(gw)
        r1, r2 = made
        assert wait_for(lambda: entry(r1.url, "r2").get("config_differs") is not None, 10)
        said = entry(r1.url, "r2")["config_differs"]
        assert f"a: {a.url}" in said and "only here: b" in said and "max_unavailable" in said
        assert wait_for(lambda: entry(r2.url, "r1").get("config_differs") is not None, 10)
        assert entry(r1.url, "r1")["config_differs"] is None  # itself
        assert any("give unrelated fleets their own coordination.namespace" in r.getMessage()
                   for r in caplog.records)
    finally:
        for gw in made:
            gw.stop()


def test_agreeing_or_silent_replicas_have_no_differences():
    mine = {"backends": {"a": "http://x:1"}, "max_unavailable": None}
    assert config_differences(mine, dict(mine)) is None
    assert config_differences(mine, {"host": "h"}) is None  # a replica that does not say
