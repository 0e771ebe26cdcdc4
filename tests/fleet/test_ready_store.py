"""Fleet mode's readiness rule (issue 15 item 4, decided on issue 14's): a replica is ready
once the shared store has answered it since start; a store outage after that never makes it
not ready (``test_admin_fleet.py``: requests still flow on the local share). A replica that
starts while Redis does not answer is not ready (503, ``failing: ["coordination"]``, the
reason), until the store answers or ``coordination.ready_grace_s`` has passed (then it is
ready on its local share: a Redis outage while every replica restarts must not leave none
ready)."""

from __future__ import annotations

import httpx

from tests.lifecycle.support import MODEL
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def test_replica_started_without_its_store_is_ready_once_the_store_answers(redis_server,
                                                                           sims):
    a = sims("A")
    redis_server.stop()
    cfg = gateway_config([{"id": "a", "url": a.url}], coordination={
        "redis_url": redis_server.url, "replica_id": "r1", "sync_interval_s": 0.1,
        "retry_interval_s": 0.2, "ready_grace_s": None})
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


def test_replica_without_its_store_is_ready_on_its_local_share_after_the_grace(redis_server,
                                                                               sims):
    a = sims("A")
    redis_server.stop()
    cfg = gateway_config([{"id": "a", "url": a.url}], coordination={
        "redis_url": redis_server.url, "replica_id": "r1", "sync_interval_s": 0.1,
        "retry_interval_s": 0.2, "ready_grace_s": 3})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        assert wait_for(lambda: httpx.get(gw.url + "/ready/fleet").status_code == 200, 15)
        first = httpx.get(gw.url + "/ready")
        assert wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, 15)
        r = httpx.get(gw.url + "/ready")
        assert "ready_grace_s" in r.json()["checks"]["coordination"]["detail"], r.text
        assert r.json()["coordination"]["fallback"] is True
        # not ready at first (unless this slow machine took the whole grace to get here)
        assert first.status_code == 503 or first.json()["checks"]["coordination"]["ok"]
        chat = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
    finally:
        gw.stop()
