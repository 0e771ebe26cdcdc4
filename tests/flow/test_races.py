"""Requests that leave or finish at the same moment as the flow acts on them (races found
by an independent review of issue 12's flow): admission evicting a waiter that just left,
and circuit-breaker probe slots while the breaker is half-open.

In-process, like :mod:`tests.flow.test_lease_releases`; the breaker's open time is real
time, so the tests that need a half-open breaker use a 20 ms open time and sleep past it.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.traffic.breaker import BreakerState
from tests.flow.support import (
    CHAT,
    Streams,
    assert_nothing_held,
    end_stream,
    make_gateway,
    run,
    settle,
    start,
)
from tests.support.transport import json_response

STREAM = {**CHAT, "stream": True}
OPEN_S = 0.02


def test_eviction_of_a_waiter_that_just_left():
    """The admission queue is full; a queued request's task is cancelled and, in the same
    turn of the loop, a high-priority request evicts the lowest waiter: that waiter's
    future is already cancelled. The high-priority request must queue (not a 500)."""
    handler = Streams()

    async def main() -> None:
        gw = make_gateway(handler, admission={"max_in_flight": 1, "max_queued": 2},
                          auth={"anonymous_max_priority": "high"})
        running = start(gw, STREAM)
        await running.started.wait()
        q1, q2 = start(gw, STREAM), start(gw, STREAM)
        await settle()
        assert gw.gate.scheduler.queued == 2
        assert q2.task is not None
        # a high-priority request arrives (its task runs first, up to the eviction) just as
        # q2's request leaves (cancelling its task cancels the future it waits on at once)
        high = start(gw, STREAM, headers=[(b"x-priority", b"high")])
        q2.task.cancel()
        await settle()
        end_stream(handler[0])
        await running.task
        await high.started.wait()
        assert high.status == 200, "the high-priority request took the freed slot"
        end_stream(handler[1])
        await high.task
        await q1.started.wait()
        end_stream(handler[2])
        await q1.task
        assert len(handler) == 3
        assert_nothing_held(gw)

    run(main())


def test_a_request_sent_before_the_trip_frees_no_probe_slot():
    """Stream A is sent while the breaker is closed; a 500 opens it; after the open time a
    probe takes the only half-open slot. A's client hanging up must not free that slot
    (no second probe goes out), and A ending well must not close the breaker while the
    probe is still out."""
    streams = Streams()
    fail = [False]

    async def handler(t, req):  # type: ignore[no-untyped-def]
        if fail[0]:
            fail[0] = False
            return json_response({"error": {"message": "boom"}}, status=500)
        return await streams(t, req)

    async def main() -> None:
        gw = make_gateway(
            handler,
            breaker={"consecutive_failures": 1, "open_base_s": OPEN_S, "half_open_max": 1},
            proxy={"max_attempts": 1},
        )
        br = gw.fleet.backends[0].breaker
        a = start(gw, STREAM)
        await a.started.wait()  # sent while closed
        fail[0] = True
        failed = start(gw, CHAT)
        await failed.task
        assert failed.status == 500 and br.state is BreakerState.OPEN
        await asyncio.sleep(OPEN_S * 2)
        probe = start(gw, STREAM)
        await probe.started.wait()
        assert br.current() is BreakerState.HALF_OPEN and br.half_open_in_flight == 1
        a.hang_up.set()
        await a.task
        assert br.half_open_in_flight == 1 and not br.can_take()
        late = start(gw, CHAT)
        await late.task
        # the gateway's fast-fail (an open breaker: 503, RFC 9110 15.6.4), no second probe
        assert late.status == 503, "a second probe went out while the first is open"
        assert late.json()["error"]["code"] == "no_backend_available"
        assert len(streams) == 2
        end_stream(streams[1])  # the probe succeeds: closed again
        await probe.task
        assert br.current() is BreakerState.CLOSED
        assert_nothing_held(gw)

    run(main())


def test_the_batcher_binds_no_more_probes_than_half_open_max():
    """Batcher on, the backend full and its breaker half-open: two slots free in one turn
    of the loop; only one queued request may be bound (the half-open slot), the other
    waits until the probe ends."""
    streams = Streams()

    async def main() -> None:
        gw = make_gateway(
            streams,
            backend={"max_num_seqs": 2},
            breaker={"open_base_s": OPEN_S, "half_open_max": 1},
            batcher={"enabled": True, "merge": False, "in_flight_per_seq": 1.0},
        )
        assert gw.batching is not None
        br = gw.fleet.backends[0].breaker
        r1, r2 = start(gw, STREAM), start(gw, STREAM)
        await r1.started.wait()
        await r2.started.wait()  # the backend is full
        for _ in range(br.cfg.consecutive_failures):  # what a run of failures does
            br.on_failure()
        assert br.state is BreakerState.OPEN
        await asyncio.sleep(OPEN_S * 2)
        assert br.current() is BreakerState.HALF_OPEN
        a, b = start(gw, STREAM), start(gw, STREAM)
        await settle()
        assert gw.batching.core.queued == 2
        assert r1.task is not None and r2.task is not None
        r1.task.cancel()
        r2.task.cancel()  # both end in one turn of the loop: two slots free at once
        await settle(50)
        assert br.half_open_in_flight == 1
        assert sum(not s.settled for s in streams) == 1, "two probes went out"
        assert gw.batching.core.queued == 1
        end_stream(streams[2])  # the probe succeeds: closed, the other one goes
        await asyncio.wait_for(asyncio.shield(b.started.wait()), 5)
        end_stream(streams[3])
        await asyncio.gather(a.task, b.task)
        for r in (r1, r2):
            with pytest.raises(asyncio.CancelledError):
                await r.task
        assert_nothing_held(gw)

    run(main())


def test_every_answer_after_admission_carries_the_rate_limits():
    """OpenAI sends ``x-ratelimit-*`` on every answer: also on a backend's own 5xx and 429
    passed through and on the gateway's own refusal, not only on successes."""
    status = [500]

    async def handler(t, req):  # type: ignore[no-untyped-def]
        return json_response({"error": {"message": "boom"}}, status=status[0])

    async def main() -> None:
        gw = make_gateway(handler, admission={"default_rpm": 60}, proxy={"max_attempts": 1})
        passed = start(gw, CHAT)
        await passed.task
        assert passed.status == 500
        assert passed.headers["x-ratelimit-limit-requests"] == "60"
        status[0] = 429  # the backend is rate-limited: its 429 is passed on
        limited = start(gw, CHAT)
        await limited.task
        assert limited.status == 429 and limited.json() == {"error": {"message": "boom"}}
        assert limited.headers["x-ratelimit-remaining-requests"] == "58"
        refused = start(gw, CHAT)  # it cools: the gateway answers 429 itself
        await refused.task
        assert refused.status == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-remaining-requests"] == "57"
        assert_nothing_held(gw)

    run(main())
