"""Fleet mode seen from outside: ``GET /admin/fleet`` lists this replica, the store (its URL
without the password, up or in fallback and why) and the live replicas; ``/ready`` carries a
``coordination`` detail and stays 200 while the store is down; the fleet-mode metrics are
exported. In the embedded default ``/admin/fleet`` is a 200 saying fleet mode is off."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.fleet import redacted_url
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def fleet(url: str, **headers: str) -> dict:
    r = httpx.get(url + "/admin/fleet", headers=headers, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def samples(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample on ``/metrics`` (also ``# TYPE`` names: 0)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, 0.0)
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_admin_fleet_lists_store_and_live_replicas(redis_server, sims, replicas):
    a = sims("A")
    r1, r2 = replicas(2, {"a": a.url}, auth={"admin_key": "adm"})
    assert httpx.get(r1.url + "/admin/fleet").status_code == 401  # same guard as /admin/*
    auth = {"authorization": "Bearer adm"}
    assert wait_for(lambda: len(fleet(r1.url, **auth)["replicas"]) == 2, 10)
    view = fleet(r1.url, **auth)
    assert view["fleet_mode"] is True and view["replica_id"] == "r1"
    assert view["store"] == {"url": redis_server.url, "up": True, "fallback": False,
                             "reason": None, "down_for_s": 0.0}
    assert [r["id"] for r in view["replicas"]] == ["r1", "r2"]
    me = view["replicas"][0]
    assert me["self"] is True and me["pid"] > 0 and me["host"] and me["listen"]
    assert 0 <= me["last_seen_s_ago"] < 5
    assert view["replicas_alive"] == 2
    assert isinstance(view["leases"], list)
    assert fleet(r2.url, **auth)["replica_id"] == "r2"


def test_store_down_shows_in_fleet_view_and_ready_stays_200(redis_server, sims, replicas):
    a = sims("A")
    (r1,) = replicas(1, {"a": a.url}, coordination={"retry_interval_s": 0.2})
    ready = httpx.get(r1.url + "/ready").json()
    assert ready["coordination"]["up"] is True and ready["coordination"]["fallback"] is False
    redis_server.stop()
    assert wait_for(lambda: fleet(r1.url)["store"]["fallback"], 10)
    down = fleet(r1.url)["store"]
    assert down["up"] is False and "does not answer" in down["reason"]
    r = httpx.get(r1.url + "/ready")
    assert r.status_code == 200, r.text  # requests still flow: keep it in the balancer
    detail = r.json()["coordination"]
    assert detail["fallback"] is True and "does not answer" in detail["reason"]
    m = samples(r1.url)
    assert m["gateway_coordination_up"] == 0 and m["gateway_coordination_fallback"] == 1
    redis_server.start()
    assert wait_for(lambda: fleet(r1.url)["store"]["up"], 10)
    assert httpx.get(r1.url + "/ready").json()["coordination"]["reason"] is None
    assert samples(r1.url)["gateway_coordination_resyncs_total"] >= 1


def test_fleet_metrics_are_exported_in_fleet_mode(redis_server, sims, replicas):
    a = sims("A")
    r1, _r2 = replicas(2, {"a": a.url})
    assert wait_for(lambda: samples(r1.url).get("gateway_fleet_replicas_alive") == 2, 10)
    m = samples(r1.url)
    assert m["gateway_coordination_up"] == 1 and m["gateway_coordination_fallback"] == 0
    for name in ("gateway_coordination_errors", "gateway_coordination_resyncs",
                 "gateway_fleet_lease_handovers", "gateway_fleet_leases_held"):
        assert name in m, name


def test_embedded_default_says_fleet_mode_is_off(sims):
    a = sims("A")
    with GatewayThread(gateway_config([{"id": "a", "url": a.url}])) as gw:
        view = fleet(gw.url)
        assert view["fleet_mode"] is False and view["replicas"] == [] and view["leases"] == []
        assert "coordination.redis_url" in view["message"]
        assert "coordination" not in httpx.get(gw.url + "/ready").json()


def test_redacted_url_hides_the_password_only():
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted_url("redis://:s3cret@redis:6379/2") == "redis://:***@redis:6379/2"
    assert redacted_url("rediss://user:pw@[::1]:6380") == "rediss://user:***@[::1]:6380"
    assert "pw" not in redacted_url("redis://default:pw@h/0?x=1")
