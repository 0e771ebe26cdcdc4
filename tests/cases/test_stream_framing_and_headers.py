"""Wire details found by a fresh-user review, each as a user meets it through real HTTP:

* a stream that ended with ``[DONE]`` framed another legal way (``data:[DONE]``, an extra
  blank line, a comment or more bytes after it) is a complete answer: relayed unchanged,
  nothing appended, the backend not counted as failing, its usage counted;
* a stream whose backend sent only an SSE comment (``: ping``) before failing has sent the
  client nothing that matters yet, so it is retried on another backend;
* the backend's own ``x-request-id`` never reaches the client, even when the backend also
  sends a ``Connection`` header (only the gateway's id goes back);
* non-ASCII header values reach the backend as the client's bytes (not double-encoded);
* a compressed request body gets 415 in the OpenAI error shape.
"""

from __future__ import annotations

import gzip
import json
import socket

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, chunk_obj, completion_obj, wait_for

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
USAGE = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m1",
         "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                  "total_tokens": 5}}


def ending_with(tail: bytes):
    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(chunk_obj("a", role="assistant"))
        await conn.event(chunk_obj("b", finish="stop"))
        await conn.event(USAGE)
        await conn.chunk(tail)
        await conn.write(b"0\r\n\r\n")

    return script


@pytest.mark.parametrize(
    "tail",
    [b"data:[DONE]\n\n", b"data: [DONE]\n\n\n", b"data: [DONE]\n\n: bye\n\n",
     b"data: [DONE]\n\ndata: {}\n\n", b"data: [DONE]\n", b"data: [DONE]"],
    ids=["no-space", "extra-blank-line", "comment-after", "data-after", "no-blank-line",
         "body-ends-after-marker"],
)
def test_done_framed_another_way_is_a_complete_stream(backends, gateway, tail):
    a = backends(ending_with(tail))
    gw = gateway({"a": a})
    for _ in range(6):  # more than the 5 failures that would open the breaker
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=CHAT,
                          timeout=10) as r:
            raw = b"".join(r.iter_raw())
        assert r.status_code == 200
        assert b"upstream_incomplete" not in raw and raw.count(b"[DONE]") == 1, raw
        assert raw.endswith(tail) or raw.endswith(b"data: [DONE]\n\n")  # sent, or completed
    m = gw.gateway.metrics
    assert m.stream_errors.labels("a", "upstream_incomplete")._value.get() == 0
    b = gw.gateway.fleet.get("a")
    assert b.breaker.consecutive == 0 and b.state.value == "warm"
    tokens = m.tokens.labels("m1", "completion")._value
    assert wait_for(lambda: tokens.get() == 12), tokens.get()  # 6 streams x 2 tokens


def test_a_comment_alone_does_not_commit_the_stream(backends, gateway):
    """The first request, wherever it lands, gets ``: ping`` and then a reset connection; it
    must be retried on the other backend and the client must see one clean answer."""
    calls = []

    async def script(req: Received, conn: Conn) -> None:
        calls.append(req.path)
        await conn.start_stream()
        if len(calls) == 1:
            await conn.chunk(b": ping\n\n")
            await conn.sleep(0.05)
            conn.reset()
            return
        await conn.event(chunk_obj("ok", role="assistant", finish="stop"))
        await conn.done()

    gw = gateway({"a": backends(script), "b": backends(script)})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok"
    assert calls == ["/v1/chat/completions"] * 2  # the first attempt, then the retry


def test_backend_request_id_never_reaches_the_client(backends, gateway):
    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(200, completion_obj("hi"),
                             headers={"x-request-id": "BACKEND-OWN", "connection": "keep-alive"})

    a = backends(script)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"x-request-id": "client-1"},
                   json={**CHAT, "stream": False})
    assert r.status_code == 200
    assert r.headers.get_list("x-request-id") == ["client-1"]


def test_non_ascii_header_values_reach_the_backend_as_sent(backends, gateway):
    a = backends()
    gw = gateway({"a": a})
    name = "José Ñandú".encode()
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps({**CHAT, "stream": False}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\nx-user-name: " + name + b"\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    got = a.data_requests[-1].headers["x-user-name"]
    assert got.encode("latin-1") == name  # the scripted backend keeps raw bytes as latin-1


def test_compressed_request_body_is_415(backends, gateway):
    a = backends()
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions",
                   content=gzip.compress(json.dumps({**CHAT, "stream": False}).encode()),
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "unsupported_content_encoding" and "gzip" in err["message"]
    assert not a.data_requests
