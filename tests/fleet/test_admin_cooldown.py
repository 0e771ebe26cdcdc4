"""An operator's cooldown in fleet mode is answered with what the fleet did: a cooldown the
receiving replica allows by its own view, but whose fleet-wide maintenance lease is refused
(another replica already took a backend of the model out), is a 409 in OpenAI's shape, never
a 202 for a cycle that then silently never runs."""

from __future__ import annotations

from tests.lifecycle.support import post_admin
from tests.support.scripted import wait_for

LC = {"max_unavailable": 1, "medium": {"cooldown_s": 3.0, "sleep": False}}


def test_cooldown_whose_fleet_lease_is_refused_answers_409_not_202(redis_server, sims, replicas):
    s = {n: sims(n) for n in ("A", "B", "C")}
    urls = {n.lower(): x.url for n, x in s.items()}
    (r1,) = replicas(1, urls, lifecycle=LC)
    # r2 reads the store only once a second: right after r1 takes `a` out, r2 still sees
    # it warm, so its own stagger check passes and only the lease can refuse
    (r2,) = replicas(1, urls, lifecycle=LC,
                     coordination={"replica_id": "r2", "sync_interval_s": 1.0})
    first = post_admin(r1.url, "a", "cooldown")
    assert first.status_code == 202, first.text
    second = post_admin(r2.url, "b", "cooldown")
    assert second.status_code == 409, second.text
    err = second.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert "cannot start a cooldown" in err["message"]
    # and the fleet kept its bound: b never left rotation on either replica
    assert wait_for(lambda: r2.gateway.fleet.get("a").state.value != "warm", 5)
    for gw in (r1, r2):
        assert gw.gateway.fleet.get("b").state.value == "warm"
