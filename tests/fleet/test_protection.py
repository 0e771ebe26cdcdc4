"""Backend protection is shared (issue 14, item 4): a 429 Retry-After cooling and a breaker
trip seen by one replica make every replica back off the backend, and the half-open probing
is done by the replica that tripped it alone. Counted at the simulated backends themselves
(their ``/sim/stats`` request counters)."""

from __future__ import annotations

import threading
import time

import httpx

from gateway.traffic.breaker import BreakerState
from tests.lifecycle.support import chat_body
from tests.support.scripted import wait_for


def _chat(url: str) -> int:
    """One small chat request; its status (a failover may still answer 200)."""
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(2), timeout=30)
    return r.status_code


def _faults(sim_url: str, **changes: object) -> None:
    httpx.patch(sim_url + "/sim/faults", json=changes, timeout=5).raise_for_status()


def test_a_429_seen_by_replica_1_keeps_replicas_2_and_3_off_the_backend(sims, replicas):
    a, b = sims("A"), sims("B")
    r1, r2, r3 = replicas(3, {"a": a.url, "b": b.url})
    _faults(a.url, rate_limit_rate=1.0, retry_after_s=6.0)
    # replica 1 alone until backend a has answered it a 429
    assert wait_for(lambda: (_chat(r1.url), a.chat_requests())[1] >= 1, 10, 0.0)
    t429 = time.monotonic()
    # a's Retry-After reaches the others within a sync round or two; give it 1 s
    assert wait_for(lambda: all(
        gw.gateway.fleet.get("a").cooling_until > time.monotonic() + 2 for gw in (r2, r3)), 3)
    time.sleep(max(0.0, t429 + 1.0 - time.monotonic()))
    seen = a.chat_requests()
    sent = 0
    while time.monotonic() < t429 + 4.5:  # well inside the 6 s cooling
        for gw in (r2, r3):
            assert _chat(gw.url) == 200  # served by b
            sent += 1
    assert sent >= 10
    assert a.chat_requests() == seen, "replicas 2 and 3 sent requests to a cooling backend"
    # the cooling ends: requests reach a again (from replica 2)
    _faults(a.url, rate_limit_rate=0.0)
    assert wait_for(lambda: (_chat(r2.url), a.chat_requests())[1] > seen, 10, 0.0)


def test_half_open_probes_of_a_tripped_breaker_are_one_per_period_fleet_wide(sims, replicas):
    a, b = sims("A"), sims("B")
    breaker = {"consecutive_failures": 2, "open_base_s": 1.5, "open_max_s": 1.5,
               "min_requests": 1000, "unhealthy_after_trips": 1000}
    r1, r2, r3 = replicas(3, {"a": a.url, "b": b.url}, breaker=breaker,
                          retry={"budget_min_per_s": 100.0})
    _faults(a.url, error_rate=1.0)
    br1 = r1.gateway.fleet.get("a").breaker
    # replica 1 trips a's breaker (its requests fail over to b)
    assert wait_for(lambda: (_chat(r1.url), br1.state is not BreakerState.CLOSED)[1], 10, 0.0)
    held = [gw.gateway.fleet.get("a").breaker for gw in (r2, r3)]
    assert wait_for(lambda: all(x.held for x in held), 3)

    stop = threading.Event()
    statuses: list[int] = []

    def client(url: str) -> None:
        while not stop.is_set():
            statuses.append(_chat(url))

    threads = [threading.Thread(target=client, args=(gw.url,)) for gw in (r1, r2, r3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        seen, period0 = a.chat_requests(), r1.run(_period(br1))
        time.sleep(9.0)
        probes, periods = a.chat_requests() - seen, r1.run(_period(br1)) - period0
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert periods >= 3, f"replica 1 went half-open {periods} times in 9 s"
    # one probe per half-open period, from replica 1 alone (without sharing: every
    # replica trips on its own failures and probes each period, 3x as many)
    assert 1 <= probes <= periods + 1, f"{probes} requests reached a in {periods} periods"
    assert statuses and set(statuses) == {200}
    assert all(x.held for x in held)

    # a recovers: replica 1's next probe closes its breaker, and the others follow
    _faults(a.url, error_rate=0.0)
    assert wait_for(lambda: (_chat(r1.url), br1.state is BreakerState.CLOSED)[1], 10, 0.0)
    assert wait_for(lambda: all(x.state is BreakerState.CLOSED for x in held), 3)
    seen = a.chat_requests()
    assert wait_for(lambda: (_chat(r2.url), a.chat_requests())[1] > seen, 10, 0.0)


def test_store_down_each_replica_probes_on_its_own_and_requests_keep_flowing(
        redis_server, sims, replicas):
    a, b = sims("A"), sims("B")
    breaker = {"consecutive_failures": 2, "open_base_s": 1.0, "open_max_s": 1.0,
               "min_requests": 1000, "unhealthy_after_trips": 1000}
    r1, r2 = replicas(2, {"a": a.url, "b": b.url}, breaker=breaker,
                      coordination={"breaker_hold_s": 1.0})
    _faults(a.url, error_rate=1.0)
    br1 = r1.gateway.fleet.get("a").breaker
    br2 = r2.gateway.fleet.get("a").breaker
    assert wait_for(lambda: (_chat(r1.url), br1.state is not BreakerState.CLOSED)[1], 10, 0.0)
    assert wait_for(lambda: br2.held, 3)
    redis_server.stop()
    # replica 2's hold ends by itself (owner unreachable); its own half-open probe goes
    # to a, fails, and its own trip keeps it off a: every request still answered by b
    _faults(a.url, error_rate=1.0)
    seen = a.chat_requests()
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        assert _chat(r2.url) == 200
    assert a.chat_requests() > seen  # r2 probed a itself
    assert not br2.held
    # the store comes back empty: r1 (or r2) writes its trip again, and the other holds
    redis_server.start()
    assert wait_for(lambda: br1.held or br2.held, 10)


async def _period(br) -> int:
    return br._period
