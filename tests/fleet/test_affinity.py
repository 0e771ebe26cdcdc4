"""Affinity agrees across replicas (issue 14, item 6): a session id maps to the same backend
from every replica and moves, all together, to the same other backend when it leaves; a
Responses API response created through one replica is continued and fetched by id through
another. Counted at the backends themselves (the simulators' recent requests, the scripted
backends' records)."""

from __future__ import annotations

import itertools

import httpx
import openai

from tests.lifecycle.support import chat_body
from tests.support.scripted import wait_for
from tests.wire.test_responses_routing import create, stateful

SESSIONS = [f"user-{k}" for k in range(8)]


def _send(url: str, session: str, rid: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(2), timeout=30,
                   headers={"x-session-id": session, "x-request-id": rid})
    assert r.status_code == 200, r.text


def _landed(sims) -> dict[str, set[str]]:
    """Session id -> the backends (sim names) its requests reached."""
    out: dict[str, set[str]] = {}
    for s in sims:
        for rq in s.stats()["recent_requests"]:
            sid = rq["headers"].get("x-session-id")
            if sid:
                out.setdefault(sid, set()).add(s.name)
    return out


def test_a_session_lands_on_one_backend_from_every_replica_and_moves_together(
        sims, replicas):
    backends = [sims(n) for n in ("A", "B", "C")]
    gws = replicas(3, {s.name.lower(): s.url for s in backends})
    n = itertools.count()
    # each session starts on a different replica, then goes through all three in turn
    for i, sid in enumerate(SESSIONS):
        for k in range(4):
            _send(gws[(i + k) % 3].url, sid, f"q{next(n)}")
    landed = _landed(backends)
    assert set(landed) == set(SESSIONS)
    split = {sid: b for sid, b in landed.items() if len(b) > 1}
    assert not split, f"sessions split over backends: {split}"
    home = {sid: next(iter(b)) for sid, b in landed.items()}
    assert len(set(home.values())) > 1  # sessions spread over the backends

    # the backend of the first session leaves: its sessions move, all to one other backend
    gone_name = home[SESSIONS[0]]
    gone = next(s for s in backends if s.name == gone_name)
    gone.kill()
    rest = [s for s in backends if s is not gone]
    for s in rest:
        httpx.delete(s.url + "/sim/stats", timeout=5)
    for gw in gws:
        assert wait_for(lambda gw=gw: gone_name.lower() not in
                        httpx.get(gw.url + "/ready/fleet").json()["routable"], 10)
    for i, sid in enumerate(SESSIONS):
        for k in range(3):
            _send(gws[(i + k) % 3].url, sid, f"q{next(n)}")
    after = _landed(rest)
    assert not {sid: b for sid, b in after.items() if len(b) > 1}, after
    for sid in SESSIONS:
        (now,) = after[sid]
        if home[sid] != gone_name:
            assert now == home[sid], f"{sid} moved from {home[sid]} to {now}"


def test_a_response_created_through_replica_1_is_continued_and_fetched_through_the_others(
        backends, replicas):
    fleet = stateful(backends, "a", "b")
    gws = replicas(3, {n: b.url for n, (b, _) in fleet.items()},
                   routing={"policy": "round_robin"})
    r1, r2, r3 = (openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0,
                                timeout=20) for gw in gws)
    ids = [create(r1, stream=k % 2 == 1) for k in range(6)]  # round robin: both backends
    assert {rid[5] for rid in ids} == {"a", "b"}
    for _, store in fleet.values():
        store.asked.clear()
    for rid in ids:
        follow = create(r2, False, previous_response_id=rid)
        assert follow[:6] == rid[:6], (rid, follow)  # continued where rid lives
        got = r3.responses.retrieve(rid)
        assert got.id == rid and got.metadata == {"backend": rid[5]}
    # by id: only the owner was asked (not each backend in turn)
    for name, (_, store) in fleet.items():
        gets = [p for m, p in store.asked if m == "GET"]
        assert all(p.split("/")[3][5] == name for p in gets), (name, gets)
    assert all(gw.gateway.metrics.response_lookups.labels("found")._value.get() > 0
               for gw in gws[1:])
