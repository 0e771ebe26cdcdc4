"""Client disconnects must close the upstream request (cases BUG-01, BUG-02)."""

from __future__ import annotations

from tests.support.rawclient import RawClient
from tests.support.scripted import Conn, Received, chunk_obj, completion_obj, wait_for

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def _served(*bks):
    """The single backend that received data requests, and the others."""
    hit = [b for b in bks if b.data_requests]
    assert len(hit) == 1, [len(b.data_requests) for b in bks]
    return hit[0], [b for b in bks if b is not hit[0]]


def _assert_clean_after_disconnect(gw, backend_id: str) -> None:
    g = gw.gateway
    b = g.fleet.get(backend_id)
    assert wait_for(lambda: b.in_flight == 0, 2), b.in_flight
    assert wait_for(lambda: g.transport.open_connections(backend_id) == 0, 2)
    assert b.state.value == "warm"
    assert b.breaker.consecutive == 0  # a client leaving is not a backend failure
    assert g.metrics.client_disconnects.labels("/v1/chat/completions")._value.get() >= 1
    assert g.metrics.requests.labels("/v1/chat/completions", "m1", "499", "")._value.get() >= 1


def test_BUG_01_stream_disconnect_closes_upstream(backends, gateway):
    written: list[int] = []

    async def slow_stream(req: Received, conn: Conn) -> None:
        n = 0
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content=""))
        for i in range(100):
            if not await conn.event(chunk_obj(content=f"t{i} ")):
                break
            n += 1
            if not await conn.sleep(0.2):
                break
        written.append(n)
        if not conn.peer_closed.is_set():
            await conn.done()

    a, b = backends(slow_stream), backends(slow_stream)
    gw = gateway({"a": a, "b": b})
    c = RawClient(gw.url)
    c.send("POST", "/v1/chat/completions", {**BODY, "stream": True})
    c.read_until(b"\n\n", count=3)
    closed_at = c.close()
    assert wait_for(lambda: any(r.peer_closed_at for r in a.data_requests + b.data_requests), 3)
    served, others = _served(a, b)
    req = served.data_requests[0]
    assert req.peer_closed_at - closed_at <= 2.0
    assert wait_for(lambda: written, 3)
    assert written[0] < 100  # the backend did not stream to completion
    assert all(not o.data_requests for o in others)  # no retry after a client close
    _assert_clean_after_disconnect(gw, "a" if served is a else "b")


def test_BUG_01_disconnect_in_ttft_window(backends, gateway):
    """Variant: the backend is silent before its first body byte; client leaves at 1 s."""

    async def headers_then_silence(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        if await conn.sleep(10):
            await conn.event(chunk_obj(content="late"))
            await conn.done()

    async def nothing_at_all(req: Received, conn: Conn) -> None:
        if await conn.sleep(10):
            await conn.send_json(200, completion_obj())

    for script in (headers_then_silence, nothing_at_all):
        a = backends(script)
        gw = gateway({"a": a})
        c = RawClient(gw.url)
        c.send("POST", "/v1/chat/completions", {**BODY, "stream": True})
        c.read_for(1.0)
        assert c.buf == b""  # nothing reached the client yet
        closed_at = c.close()
        assert wait_for(lambda a=a: a.data_requests and a.data_requests[0].peer_closed_at, 3)
        assert a.data_requests[0].peer_closed_at - closed_at <= 2.0
        _assert_clean_after_disconnect(gw, "a")


def test_BUG_02_non_stream_disconnect_cancels_upstream(backends, gateway):
    async def slow_answer(req: Received, conn: Conn) -> None:
        if await conn.sleep(30):
            await conn.send_json(200, completion_obj())

    a, b = backends(slow_answer), backends(slow_answer)
    gw = gateway({"a": a, "b": b})
    def closed() -> list:
        return [r for r in a.data_requests + b.data_requests if r.peer_closed_at]

    for i in range(5):
        c = RawClient(gw.url)
        c.send("POST", "/v1/chat/completions", {**BODY, "max_tokens": 2048})
        c.read_for(1.0)
        closed_at = c.close()
        assert wait_for(lambda i=i: len(closed()) == i + 1, 3)
        assert max(r.peer_closed_at for r in closed()) - closed_at <= 2.0
    assert len(a.data_requests) + len(b.data_requests) == 5  # no failover after a close
    assert a.max_open <= 1 and b.max_open <= 1  # never stacked
    for bid in ("a", "b"):
        backend = gw.gateway.fleet.get(bid)
        assert backend.state.value == "warm"
        assert backend.breaker.consecutive == 0
    counted = gw.gateway.metrics.requests.labels("/v1/chat/completions", "m1", "499", "")
    assert counted._value.get() == 5
