"""Fleet mode's readiness rule (issue 15 item 4, decided on issue 14's): a replica is ready
once the shared store has answered it since start; a store outage after that never makes it
not ready (``test_admin_fleet.py``: requests still flow on the local share). A replica that
starts while Redis does not answer is not ready (503, ``failing: ["coordination"]``, the
reason), until the store answers."""

from __future__ import annotations

import httpx

from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def test_replica_started_without_its_store_is_ready_once_the_store_answers(redis_server,
                                                                           sims):
    a = sims("A")
    redis_server.stop()
    cfg = gateway_config([{"id": "a", "url": a.url}], coordination={
        "redis_url": redis_server.url, "replica_id": "r1", "sync_interval_s": 0.1,
        "retry_interval_s": 0.2})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        assert wait_for(lambda: httpx.get(gw.url + "/ready/fleet").status_code == 200, 15)
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 503 and r.json()["failing"] == ["coordination"], r.text
        detail = r.json()["checks"]["coordination"]["detail"]
        assert "has not answered since start" in detail, detail
        assert r.json()["coordination"]["fallback"] is True
        redis_server.start()
        assert wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, 15), \
            httpx.get(gw.url + "/ready").text
        redis_server.stop()  # an outage after start: still ready (local share)
        assert wait_for(lambda: httpx.get(gw.url + "/ready").json()["coordination"]["fallback"],
                        10)
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 200 and r.json()["checks"]["coordination"]["ok"], r.text
        assert "local share" in r.json()["checks"]["coordination"]["detail"]
    finally:
        gw.stop()
