"""Upstream failures around streams: partial chunks then an explicit error, and never a
retry once bytes reached the client (cases BUG-09, BUG-10) when the stream is not continued
(issue 17: these requests say ``x-gateway-continuation: off``; a stream continued on
another backend is tests/lifecycle/test_continuation.py's)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.scripted import (
    Conn,
    Received,
    chunk_obj,
    completion_obj,
    default_script,
    wait_for,
)

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def busy_control(waiting: int = 50):
    """Control-plane script reporting a long queue, so the router prefers the other backend."""

    async def control(req: Received, conn: Conn) -> None:
        if req.path == "/metrics":
            text = (f'vllm:num_requests_running{{engine="0"}} 16.0\n'
                    f'vllm:num_requests_waiting{{engine="0"}} {waiting}.0\n'
                    'vllm:kv_cache_usage_perc{engine="0"} 0.9\n')
            await conn.send_response(200, text.encode(), content_type="text/plain")
        else:
            await default_script(req, conn)

    return control


def wait_busy(gw, backend_id: str = "b", waiting: int = 50) -> None:
    """Wait until the gateway's load sample of ``backend_id`` shows the queue
    :func:`busy_control` reports: before its first scrape the router knows nothing of it and
    may pick it (round-robin tie-break)."""
    b = gw.gateway.fleet.get(backend_id)
    assert wait_for(lambda: b.load is not None and b.load.waiting == waiting, 5), b.load


def events_of(raw: bytes) -> list[bytes]:
    """Payloads of ``data:`` events, asserting strict LF framing."""
    assert b"\r" not in raw
    assert raw.endswith(b"\n\n")
    out = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block
        out.append(block[len(b"data: "):])
    return out


NO_CONTINUATION = {"x-gateway-continuation": "off"}


def stream_raw(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=30, headers=headers
    ) as r:
        return r.status_code, b"".join(r.iter_raw())


ROLE = chunk_obj(role="assistant")
PARTIAL = chunk_obj(content="partial ")


@pytest.mark.parametrize("ending", ["fin", "rst", "half_event"])
def test_BUG_09_upstream_dies_mid_stream(backends, gateway, ending):
    async def dies(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(ROLE)
        await conn.event(PARTIAL)
        if ending == "half_event":
            await conn.chunk(b'data: {"id":"c1","choi')
        await conn.sleep(0.05)
        conn.reset() if ending == "rst" else conn.close()

    a = backends(dies)
    b = backends(control=busy_control())
    gw = gateway({"a": a, "b": b})
    wait_busy(gw)
    status, raw = stream_raw(gw.url, {**BODY, "stream": True}, NO_CONTINUATION)
    assert status == 200
    events = events_of(raw)
    assert events[0] == json.dumps(ROLE).encode()  # byte-identical, in order
    assert events[1] == json.dumps(PARTIAL).encode()
    err = json.loads(events[2])["error"]
    assert err["message"] and err["type"] == "server_error" and err["param"] is None
    assert err["code"] == "upstream_disconnected"
    assert events[3:] == [b"[DONE]"]  # exactly one error, then [DONE]; no fake finish
    assert b"finish_reason\": \"stop" not in raw
    assert not b.data_requests  # no retry once bytes were sent
    g = gw.gateway
    assert wait_for(lambda: g.fleet.get("a").breaker.consecutive == 1)  # charged to A's breaker
    assert g.metrics.stream_errors.labels("a", "upstream_disconnected")._value.get() == 1

    # The SDK yields both chunks, then raises.
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0,
                           default_headers=NO_CONTINUATION)
    got = []
    with pytest.raises(openai.APIError):
        for ch in client.chat.completions.create(**{**BODY, "stream": True}):
            got.append(ch.choices[0].delta.content)
    assert got == [None, "partial "]


def test_BUG_10_late_failure_never_retried(backends, gateway):
    async def a_script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(ROLE)
        for t in "abcde":
            await conn.event(chunk_obj(content=t))
        await conn.sleep(0.05)
        conn.reset()

    async def b_script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(ROLE)
        for t in "XYZ":
            await conn.event(chunk_obj(content=t))
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()

    a = backends(a_script)
    b = backends(b_script, control=busy_control())
    gw = gateway({"a": a, "b": b})
    wait_busy(gw)
    status, raw = stream_raw(gw.url, {**BODY, "stream": True}, NO_CONTINUATION)
    assert status == 200
    events = events_of(raw)
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert "".join(c or "" for c in contents) == "abcde"
    assert sum(b'"role"' in e for e in events) == 1
    assert "error" in json.loads(events[-2]) and events[-1] == b"[DONE]"
    assert raw.count(b"[DONE]") == 1
    assert not b.data_requests


@pytest.mark.parametrize("how", ["refused", "503"])
def test_BUG_10_early_failure_fails_over(backends, gateway, how):
    async def a_503(req: Received, conn: Conn) -> None:
        await conn.send_json(503, {"error": {"message": "overloaded", "type": "ServiceUnavailable",
                                             "param": None, "code": 503}})

    async def b_script(req: Received, conn: Conn) -> None:
        body = req.json()
        if not body.get("stream"):
            await conn.send_json(200, completion_obj("XYZ"))
            return
        await conn.start_stream()
        await conn.event(ROLE)
        for t in "XYZ":
            await conn.event(chunk_obj(content=t))
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()

    a = backends(a_503)
    b = backends(b_script, control=busy_control())
    # slow probes: A must still look routable when its port is closed
    gw = gateway({"a": a, "b": b}, health={"interval_s": 5.0})
    wait_busy(gw)
    if how == "refused":
        a.stop()
    status, raw = stream_raw(gw.url, {**BODY, "stream": True})
    assert status == 200
    events = events_of(raw)
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == "XYZ" and events[-1] == b"[DONE]" and raw.count(b"[DONE]") == 1
    assert sum(b'"role"' in e for e in events) == 1
    assert len(a.data_requests) <= 1 and len(b.data_requests) == 1

    # Non-streaming: a failure before the answer is retried; one complete body.
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "XYZ"
