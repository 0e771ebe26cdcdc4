"""In fleet mode one reload reaches every replica (issue 18, Deliver 1 and 2).

Three gateway replicas share a real Redis in front of simulated backends. A config posted to
one replica is applied by every replica under one fleet version; a rollback sent to another
returns them all; a replica started later starts with the fleet's config; the configs are
kept in the store (``GET /admin/config/history`` on any replica lists the fleet's); with the
store down a reload is refused (503 ``coordination_unavailable``) and changes nothing
anywhere; a replica that cannot apply the fleet's config keeps its own and says so in
``GET /admin/fleet`` and its metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import create_app
from tests.lifecycle.support import Sim, metric, metric_samples
from tests.support.reload_client import config_text, ids, post_config
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


@pytest.fixture
def extra(redis_server: Any) -> Iterator[Callable[..., GatewayThread]]:
    """Factory ``extra(replica_id, {"a": url}, **sections)``: one more started replica on the
    test's Redis (beside the ``replicas`` fixture's r1..rn), stopped at the end."""
    made: list[GatewayThread] = []

    def make(rid: str, urls: dict[str, str], **sections: Any) -> GatewayThread:
        coord = {"redis_url": redis_server.url, "replica_id": rid, "sync_interval_s": 0.1}
        cfg = gateway_config([{"id": k, "url": u} for k, u in urls.items()],
                             coordination=coord, **sections)
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=30)
        return gw

    yield make
    for gw in made:
        gw.stop()








def version(gw: GatewayThread) -> int:
    r = httpx.get(gw.url + "/admin/config", timeout=5)
    assert r.status_code == 200, r.text
    return int(r.json()["version"])


def fleet_view(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/fleet", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_reload_on_one_replica_reaches_every_replica_and_a_rollback_on_another_too(
    sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]],
    extra: Callable[..., GatewayThread], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.coord")
    a, b = sims("a"), sims("b")
    r1, r2, r3 = replicas(3, {"a": a.url})
    assert wait_for(lambda: len({version(gw) for gw in (r1, r2, r3)}) == 1, timeout=10)
    before = version(r1)

    r = post_config(r1, config_text(r1, {"a": a.url, "b": b.url}))
    assert r.status_code == 200, r.text
    added = r.json()
    assert added["applied"] is True and added["backends_added"] == ["b"]
    assert added["version"] > before
    for gw in (r2, r3):  # the other replicas list b and run the same version
        assert wait_for(lambda gw=gw: "b" in ids(gw), timeout=10)
        assert wait_for(lambda gw=gw: version(gw) == added["version"], timeout=10)
    assert version(r1) == added["version"]
    # the fleet's kept configs, read from the store on any replica
    hist = httpx.get(r2.url + "/admin/config/history", timeout=5).json()
    assert hist["fleet"] is True and hist["from"] == "store"
    assert [s["version"] for s in hist["data"]] == [added["version"], before]
    assert hist["data"][0]["source"] == "admin"
    assert hist["data"][0]["summary"]["by"] == "r1"
    # /admin/fleet: every replica runs the fleet's version, none refused, none differs
    assert wait_for(lambda: all(
        rep["config_version"] == added["version"] and rep["config_refused"] is None
        and rep["config_differs"] is None for rep in fleet_view(r1)["replicas"]), timeout=10)

    # a replica started after the change starts with the fleet's config
    r4 = extra("r4", {"a": a.url})
    assert wait_for(lambda: "b" in ids(r4) and version(r4) == added["version"], timeout=10)
    assert r4.gateway.cfg.coordination.replica_id == "r4"  # its own fields stay its own

    # a rollback sent to replica 3 returns every replica to the config without b
    r = httpx.post(r3.url + "/admin/config/rollback", timeout=10)
    assert r.status_code == 200, r.text
    rolled = r.json()
    assert rolled["applied"] is True and rolled["backends_removed"] == ["b"]
    assert rolled["version"] > added["version"]
    for gw in (r1, r2, r3, r4):  # b drained, then gone everywhere
        assert wait_for(lambda gw=gw: "b" not in ids(gw), timeout=15)
        assert wait_for(lambda gw=gw: version(gw) == rolled["version"], timeout=10)
    m = metric_samples(r2.url)
    assert metric(m, "gateway_config_reloads_total", source="fleet", outcome="applied") == 2.0
    # a reload on its way is not the unrelated-fleets warning of config_differs
    assert not [r.getMessage() for r in caplog.records if "config differs" in r.getMessage()]
    assert metric(m, "gateway_config_fleet_version") == float(rolled["version"])


def test_with_the_store_down_a_reload_is_refused_and_changes_nothing_anywhere(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]],
) -> None:
    a, b = sims("a"), sims("b")
    gws = replicas(3, {"a": a.url})
    assert wait_for(lambda: len({version(gw) for gw in gws}) == 1, timeout=10)
    before = version(gws[0])
    redis_server.stop()
    assert wait_for(lambda: all(gw.gateway.coord.link.fallback for gw in gws), timeout=10)

    r = post_config(gws[0], config_text(gws[0], {"a": a.url, "b": b.url}))
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "coordination_unavailable"
    assert "nothing changed on any replica" in err["message"]
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(gws[1].url + "/admin/config/rollback", timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "coordination_unavailable"
    time.sleep(0.5)  # a wrongly applied change would show by now
    for gw in gws:
        assert ids(gw) == {"a"} and version(gw) == before
    hist = httpx.get(gws[2].url + "/admin/config/history", timeout=5).json()
    assert hist["from"] == "local"  # the store does not answer: this replica's own


def test_a_replica_that_cannot_apply_the_fleets_config_keeps_its_own_and_says_so(
    sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]],
    extra: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    r1, r2 = replicas(2, {"a": a.url})
    # r3's retry settings differ: they cannot change while it runs, so it refuses the
    # fleet's config (the same happens to a replica whose env lacks a key the config names)
    r3 = extra("r3", {"a": a.url}, retry={"backoff_max_s": 2.0})
    r = post_config(r1, config_text(r1, {"a": a.url, "b": b.url}))
    assert r.status_code == 200, r.text
    v = r.json()["version"]
    assert wait_for(lambda: "b" in ids(r2) and version(r2) == v, timeout=10)

    def r3_seen() -> dict[str, Any]:
        return next(rep for rep in fleet_view(r1)["replicas"] if rep["id"] == "r3")

    assert wait_for(lambda: (r3_seen()["config_refused"] or "").startswith(f"version {v}:"),
                    timeout=10)
    seen = r3_seen()
    assert "retry.backoff_max_s" in seen["config_refused"]
    assert seen["config_version"] != v
    assert ids(r3) == {"a"}  # r3 runs its own config still
    assert fleet_view(r3)["config"] == {"running_version": version(r3), "fleet_version": v}
    m = metric_samples(r3.url)
    assert metric(m, "gateway_config_fleet_version") == float(v)
    assert metric(m, "gateway_config_version") != float(v)
    assert (metric(m, "gateway_config_reloads_total", source="fleet", outcome="refused")
            or 0) >= 1


def test_a_watched_file_edited_while_the_store_is_down_reaches_the_fleet_once_it_answers(
    redis_server: Any, sims: Callable[..., Sim], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="gateway.config")
    a, b = sims("a"), sims("b")
    coord = {"redis_url": redis_server.url, "sync_interval_s": 0.1, "retry_interval_s": 0.2}

    def cfg(rid: str, watch: bool) -> Any:
        return gateway_config([{"id": "a", "url": a.url}],
                              coordination={**coord, "replica_id": rid},
                              reload={"watch": watch, "watch_interval_s": 0.1})

    path = tmp_path / "gateway.yaml"
    c1 = cfg("r1", True)
    path.write_text(yaml.safe_dump(c1.model_dump(mode="json")))
    r1, r2 = GatewayThread(c1), GatewayThread(cfg("r2", False))
    r1.app = create_app(c1, config_path=path)  # r1 watches its config file
    gws = [r1, r2]
    try:
        for gw in gws:
            gw.start()
        assert wait_for(lambda: version(r1) == version(r2), timeout=10)
        redis_server.stop()
        assert wait_for(lambda: all(gw.gateway.coord.link.fallback for gw in gws), timeout=10)
        path.write_text(config_text(r1, {"a": a.url, "b": b.url}))

        def refused() -> list[logging.LogRecord]:
            return [r for r in caplog.records
                    if "(watch)" in r.getMessage() and "not applied" in r.getMessage()]

        assert wait_for(lambda: len(refused()) >= 1, timeout=10)
        time.sleep(0.8)  # several more watch rounds: refused, logged once, applied nowhere
        assert ids(r1) == {"a"} and ids(r2) == {"a"}
        logged = refused()
        assert len(logged) == 1 and "nothing changed on any replica" in logged[0].getMessage()
        redis_server.start()  # empty, as a Redis without persistence: seeded again
        for gw in gws:
            assert wait_for(lambda gw=gw: "b" in ids(gw), timeout=10)
        assert wait_for(lambda: version(r1) == version(r2), timeout=10)
    finally:
        for gw in gws:
            gw.stop()
