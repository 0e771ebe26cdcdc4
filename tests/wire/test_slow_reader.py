"""Issue 13, kind 3: a client that stops reading is not a client.

A streaming client that stops reading but keeps its socket open used to hold the backend's
generation and the admission slot for ever (uvicorn has no write timeout and the relay
turns its idle timer off while it writes). With ``server.client_write_timeout_s`` a write
to the client that makes no progress for that long closes the client's connection: the
upstream request is closed (vLLM aborts), everything the request held is given back, and
it is counted as a client disconnect. A slow but steady reader is never cut.

Real HTTP through uvicorn; the client is a raw socket with a small receive buffer, so the
gateway's writes block as soon as it stops reading.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.scripted import Conn, Received, chunk_obj, completion_obj, wait_for

WRITE_TIMEOUT_S = 1.0
EVENT_BYTES = 64 * 1024  # each event's text: large, so buffers fill after a few events
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "m1", "prompt": "hi", "max_tokens": 64},
    "/v1/responses": {"model": "m1", "input": "hi"},
}


def _event(path: str, text: str) -> bytes:
    """One SSE event of ``path``'s stream kind carrying ``text``."""
    if path == "/v1/responses":
        obj = {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
               "content_index": 0, "delta": text, "sequence_number": 1}
        return b"event: response.output_text.delta\ndata: " + json.dumps(obj).encode() + b"\n\n"
    if path == "/v1/completions":
        obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"data: " + json.dumps(chunk_obj(content=text)).encode() + b"\n\n"


def _end(path: str) -> bytes:
    if path == "/v1/responses":
        obj = {"type": "response.completed", "sequence_number": 2,
               "response": {"id": "resp_1", "object": "response", "status": "completed",
                            "output": []}}
        return b"event: response.completed\ndata: " + json.dumps(obj).encode() + b"\n\n"
    return b"data: [DONE]\n\n"


def big_stream(events: int):
    """Data plane: a stream of ``events`` large events as fast as the gateway takes them
    (the backend's writes block while the gateway does not read), then its end; a
    non-stream request gets a plain answer."""

    async def script(req: Received, conn: Conn) -> None:
        if not req.json().get("stream"):
            await conn.send_json(200, completion_obj("ok"))
            return
        await conn.start_stream()
        for _ in range(events):
            if not await conn.chunk(_event(req.path, "x" * EVENT_BYTES)):
                return  # the gateway closed the connection
        if await conn.chunk(_end(req.path)):
            await conn.write(b"0\r\n\r\n")

    return script


def open_stream(url: str, path: str, body: dict[str, Any], rcvbuf: int) -> socket.socket:
    """A raw client socket with a ``rcvbuf``-byte receive buffer that has sent ``body``."""
    u = urlsplit(url)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((u.hostname or "127.0.0.1", u.port or 80))
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n")
    s.sendall(head.encode() + data)
    return s


def read_until(s: socket.socket, count: int, marker: bytes = b"\n\n") -> bytes:
    """Read until ``marker`` appeared ``count`` times (the head's blank line included)."""
    s.settimeout(10)
    buf = b""
    while buf.count(marker) < count:
        chunk = s.recv(65536)
        assert chunk, f"server closed early: {buf[:300]!r}"
        buf += chunk
    return buf


def _gateway(gateway, a, batcher: bool):
    sections: dict[str, Any] = {
        "server": {"client_write_timeout_s": WRITE_TIMEOUT_S},
        "admission": {"max_in_flight": 1},
    }
    if batcher:
        sections["batcher"] = {"enabled": True}
    return gateway({"a": a}, **sections)


@pytest.mark.parametrize("batcher", [False, True], ids=["batcher_off", "batcher_on"])
@pytest.mark.parametrize("path", list(BODIES))
def test_client_that_stops_reading_is_not_a_client(backends, gateway, path, batcher):
    """The client reads the head and a few events, then stops reading with its socket
    open: within the write timeout (plus the time buffers take to fill) the backend sees
    its connection closed, the admission slot and backend slot are free (a second request
    is served with ``admission.max_in_flight: 1``), and a client disconnect (499) is
    counted, not a backend failure."""
    a = backends(big_stream(events=4000))  # 256 MB: never all sent
    gw = _gateway(gateway, a, batcher)
    s = open_stream(gw.url, path, {**BODIES[path], "stream": True}, rcvbuf=4096)
    try:
        read_until(s, count=3)  # the head, then two events
        # ... and the client reads no more, its socket open
        assert wait_for(lambda: a.data_requests and a.data_requests[0].peer_closed_at, 15), (
            "the backend is still streaming to a client that stopped reading"
        )
        g = gw.gateway
        b = g.fleet.get("a")
        assert wait_for(lambda: b.in_flight == 0, 5), b.in_flight
        assert wait_for(lambda: g.gate.scheduler.in_flight == 0, 5), g.gate.scheduler.in_flight
        r = httpx.post(gw.url + path, json=BODIES[path], timeout=10)
        assert r.status_code == 200, r.text
        assert g.metrics.client_disconnects.labels(path)._value.get() == 1
        assert g.metrics.requests.labels(path, "m1", "499", "")._value.get() == 1
        assert g.metrics.upstream_attempts.labels("a", "client_gone")._value.get() == 1
        assert b.breaker.consecutive == 0  # not the backend's fault
    finally:
        s.close()


def test_client_that_stops_reading_a_body_is_not_a_client(backends, gateway):
    """Non-stream: a large answer to a client that never reads it is not kept buffered
    for ever; its connection is closed after the write timeout."""
    big = completion_obj("y" * (8 * 1024 * 1024))

    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(200, big)

    a = backends(script)
    gw = gateway({"a": a}, server={"client_write_timeout_s": WRITE_TIMEOUT_S})
    server = gw._server
    assert server is not None
    s = open_stream(gw.url, "/v1/chat/completions", CHAT, rcvbuf=4096)
    try:
        assert wait_for(lambda: a.data_requests and a.data_requests[0].finished_at, 10)
        assert wait_for(lambda: not server.server_state.connections, 15), (
            "the gateway keeps a connection to a client that does not read"
        )
        s.settimeout(5)
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        assert got < len(json.dumps(big))  # the answer was cut, not delivered
    finally:
        s.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_slow_steady_reader_is_a_client(backends, gateway, path):
    """A client that reads a little every 0.2 s gets its whole stream with the same write
    timeout, however long the stream takes."""
    events = 16  # 1 MiB
    a = backends(big_stream(events=events))
    gw = _gateway(gateway, a, batcher=False)
    s = open_stream(gw.url, path, {**BODIES[path], "stream": True}, rcvbuf=64 * 1024)
    end = _end(path)
    buf = b""
    started = time.monotonic()
    try:
        s.settimeout(10)
        while not buf.endswith(b"0\r\n\r\n") and time.monotonic() - started < 60:
            chunk = s.recv(64 * 1024)
            assert chunk, f"cut after {len(buf)} bytes"
            buf += chunk
            time.sleep(0.2)
    finally:
        s.close()
    assert buf.count(b"x" * EVENT_BYTES) == events
    assert end in buf and b"error" not in buf
    g = gw.gateway
    assert g.metrics.client_disconnects.labels(path)._value.get() == 0
    assert g.metrics.requests.labels(path, "m1", "200", "")._value.get() == 1
