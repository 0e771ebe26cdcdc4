"""Two replicas given the same ``coordination.replica_id`` (one config copied to two hosts):
the id belongs to the first; the second runs on its local share, says why (``/ready``,
``/admin/fleet``, admin writes 503 in OpenAI shape), and takes the id once it is free. Before,
both stamped the same heartbeat silently: ``/admin/fleet`` counted one replica for two,
and both would act as the holder of that id's maintenance leases and quota chunks."""

from __future__ import annotations

import httpx

from tests.lifecycle.support import MODEL
from tests.support.scripted import wait_for

TAKEN = "in use by another live replica"


def view(url: str) -> dict:
    return httpx.get(url + "/admin/fleet", timeout=5).json()


def test_colliding_replica_id_is_refused_and_said_then_taken_once_free(redis_server, sims,
                                                                        replicas):
    a = sims("A")
    both = replicas(2, {"a": a.url}, coordination={"replica_id": "dup", "retry_interval_s": 0.2})
    assert wait_for(lambda: sum(view(r.url)["store"]["up"] for r in both) == 1, 10)
    owner, other = sorted(both, key=lambda r: not view(r.url)["store"]["up"])

    # steadily: the owner up, the other refused (no flip-flop), one replica "dup" listed
    for _ in range(5):
        assert view(owner.url)["store"]["up"] and not view(other.url)["store"]["up"]
        assert [r["id"] for r in view(owner.url)["replicas"]] == ["dup"]
        wait_for(lambda: False, 0.2)

    # the other says why, keeps serving, and refuses admin writes
    store = view(other.url)["store"]
    assert store["fallback"] is True and TAKEN in store["reason"], store
    assert "coordination.replica_id" in store["reason"]
    ready = httpx.get(other.url + "/ready")
    assert ready.status_code == 200 and TAKEN in ready.json()["coordination"]["reason"]
    r = httpx.post(other.url + "/admin/backends/a/drain", timeout=5)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "coordination_unavailable"
    assert TAKEN in r.json()["error"]["message"]
    ok = httpx.post(other.url + "/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text

    # the owner stops gracefully: the id is free, the other takes it
    owner.stop()
    assert wait_for(lambda: view(other.url)["store"]["up"], 10)
    assert [r["id"] for r in view(other.url)["replicas"]] == ["dup"]
