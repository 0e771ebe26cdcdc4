"""Kinds of wire bugs other gateways, routers and HTTP libraries were reported for, tried on
this one (issue 13, "Beyond these"). One test per kind, named after it; each docstring cites
the public reports it comes from (the full list, with what happened there, is
``docs/wire-reports.md``).

Everything goes through real HTTP: scripted backends that misbehave at the socket level, the
gateway under uvicorn, and the ``openai`` SDK, httpx or a raw socket as the client (a raw
socket where the bytes on the wire are the point).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.proxy.upstream import STALE_WINDOW_S
from tests.support.scripted import (
    Conn,
    Received,
    chunk_obj,
    completion_obj,
    default_script,
    wait_for,
)
from tests.support.servers import GatewayThread

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
EMBED = {"model": "m1", "input": "hi"}
EMBEDDING = {"object": "list", "model": "m1",
             "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
             "usage": {"prompt_tokens": 1, "total_tokens": 1}}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
              "choices": [{"index": 0, "text": "ok", "logprobs": None,
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m1",
            "status": "completed",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}

Script = Callable[[Received, Conn], Awaitable[None]]


async def answer(req: Received, conn: Conn, headers: dict[str, str] | None = None) -> None:
    """A healthy vLLM-like answer for whichever endpoint ``req`` is (stream or not)."""
    body = req.json() if req.body else {}
    if req.path == "/v1/responses":
        done = {"type": "response.completed", "response": RESPONSE}
        if not body.get("stream"):
            await conn.send_json(200, RESPONSE, headers)
            return
        await conn.start_stream(headers=headers)
        for event in ({"type": "response.created", "response": {**RESPONSE, "status":
                                                                "in_progress"}},
                      {"type": "response.output_text.delta", "delta": "ok"}, done):
            await conn.chunk(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await conn.write(b"0\r\n\r\n")
    elif req.path == "/v1/embeddings":
        await conn.send_json(200, EMBEDDING, headers)
    elif req.path == "/v1/completions" and not body.get("stream"):
        await conn.send_json(200, COMPLETION, headers)
    elif body.get("stream"):
        await conn.start_stream(headers=headers)
        await conn.event(chunk_obj(role="assistant", content=""))
        await conn.event(chunk_obj(content="ok"))
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()
    else:
        await conn.send_json(200, completion_obj("ok"), headers)


def raw_exchange(gw: GatewayThread, request: bytes, until: bytes = b"", timeout: float = 10
                 ) -> bytes:
    """Write ``request`` to the gateway on a fresh socket and read until ``until`` is in
    what came back (or the peer closes)."""
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while not until or until not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def post_bytes(path: str, body: dict[str, Any], extra: bytes = b"") -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n").encode() + extra + b"\r\n" + raw


def head_of(data: bytes) -> list[tuple[str, str]]:
    """The header lines of the first HTTP answer in ``data`` (names lower-cased)."""
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in head)]


def tokens_counted(gw: GatewayThread) -> dict[str, float]:
    """``gateway_tokens_total`` of model m1 by kind, as the gateway's /metrics shows it."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(gw.url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "gateway_tokens_total" and s.labels.get("model") == "m1":
                out[s.labels["kind"]] = s.value
    return out


# ---- connection reuse and keep-alive -------------------------------------------------------

# (path, body, stream) for each endpoint kind the stale-connection race can hit
ENDPOINTS = {
    "chat": ("/v1/chat/completions", CHAT, False),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}, True),
    "completions": ("/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 4}, False),
    "embeddings": ("/v1/embeddings", EMBED, False),
    "responses": ("/v1/responses", {"model": "m1", "input": "hi"}, False),
    "responses-stream": ("/v1/responses", {"model": "m1", "input": "hi", "stream": True}, True),
    "passthrough": ("/tokenize", {"model": "m1", "prompt": "hi"}, False),
}


def stale_after_first() -> Script:
    """A backend whose idle keep-alive connections die under the client: the first request
    on every connection is answered (keep-alive), any later request on the same connection
    finds it closed (read, then FIN without an answer: what a server's keep-alive timeout
    looks like to a client that wrote into the closing connection)."""
    seen: weakref.WeakSet[asyncio.StreamWriter] = weakref.WeakSet()

    async def script(req: Received, conn: Conn) -> None:
        if conn.writer in seen:
            conn.close()
            return
        seen.add(conn.writer)
        await answer(req, conn)

    return script


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
def test_stale_pooled_connection_is_retried_transparently(backends, gateway, endpoint, batcher):
    """A pooled keep-alive connection the backend closed after its last answer is retried
    on a fresh connection, invisibly to the client, even with a single backend: the
    backend never saw the request. Reports: aiohttp#7297 (reuse of a connection the server
    closed), aiohttp#9138 (keep-alive timeout race -> ServerDisconnectedError), aiohttp#3507,
    ThunderAgent#35 (httpx ReadError on a stale pooled connection to vLLM, retried),
    litellm#4097 / litellm#4178 (retry on a backend disconnect), aiohttp#850."""
    a = backends(stale_after_first())
    sections: dict[str, Any] = {"batcher": {"enabled": True}} if batcher else {}
    gw = gateway({"a": a}, **sections)
    path, body, stream = ENDPOINTS[endpoint]
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for i in range(4):
            r = client.post(path, json=body)
            assert r.status_code == 200, (i, r.status_code, r.text)
            if stream:
                end = "response.completed" if "responses" in endpoint else "data: [DONE]"
                assert end in r.text and "error" not in r.text, r.text
            else:
                assert "error" not in r.json(), r.text
    # each request after the first met the stale connection once, then a fresh one
    assert len(a.data_requests) >= 5


def test_fresh_connection_closed_without_answer_is_not_resent(backends, gateway):
    """The other side of the stale-connection retry: a backend that reads a request on a
    new connection and closes it without an answer may have taken it (a crash on this very
    request), so the transport does not send it again; with no other backend the client
    gets an OpenAI-shaped 502 after exactly one try. Reports: aio-libs/aiohttp#2867
    (maintainers: a request whose connection aborted cannot be retried blindly),
    aio-libs/aiohttp#850."""

    async def hang_up(req: Received, conn: Conn) -> None:
        conn.close()

    a = backends(hang_up)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 502, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert len(a.data_requests) == 1


def took_then_died() -> Script:
    """A backend that answers every request, except one whose body says ``poison``: that one
    it reads, works on for a while (0.15 s, 1.5 times the gateway's stale-race window
    ``STALE_WINDOW_S``: the drop comes at least that long after the gateway took the pooled
    connection, so past the window however slow the machine), then its connection drops
    without an answer (a worker crash, a "query of death")."""

    async def script(req: Received, conn: Conn) -> None:
        if b"poison" in req.body:
            await conn.sleep(1.5 * STALE_WINDOW_S)
            conn.close()
            return
        await answer(req, conn)

    return script


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
def test_stale_connection_resend_never_repeats_a_request_the_backend_took(
    backends, gateway, endpoint, batcher
):
    """Only the stale keep-alive race is re-sent on the same backend: a request that went out
    on a reused pooled connection and was taken (the backend worked on it, then the
    connection dropped before any answer) is a broken connection like any other. Each
    backend gets it once (one attempt each, ``proxy.max_attempts`` 2), and the client an
    OpenAI-shaped 502. Reports: the tryout's exp10/exp10b (delivered 3 times per backend),
    aio-libs/aiohttp#2867 (an aborted request cannot be retried blindly), RFC 9112 section
    9.3.1, golang/go ``persistConn.shouldRetryRequest`` (re-send only what the server closed
    while idle)."""
    a, b = backends(took_then_died()), backends(took_then_died())
    sections: dict[str, Any] = {"batcher": {"enabled": True}} if batcher else {}
    gw = gateway({"a": a, "b": b}, proxy={"keepalive_timeout_s": 30}, **sections)
    path, body, _ = ENDPOINTS[endpoint]
    with httpx.Client(base_url=gw.url, timeout=20) as client:
        # both backends serve once: each leaves a pooled connection the next send reuses
        for _ in range(40):
            if a.data_requests and b.data_requests:
                break
            assert client.post(path, json=body).status_code == 200
        assert a.data_requests and b.data_requests
        poison = json.loads(json.dumps(body).replace('"hi"', '"poison"'))
        r = client.post(path, json=poison)
    assert r.status_code == 502, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    got = {name: sum(b"poison" in q.body for q in bk.data_requests)
           for name, bk in (("a", a), ("b", b))}
    assert got == {"a": 1, "b": 1}, got


def test_keep_alive_header_that_lies_does_not_fail_requests(backends, gateway):
    """A backend that says ``connection: keep-alive`` but closes the socket right after every
    answer, and one that sends ``connection: close``: every sequential request is answered
    (no ServerDisconnectedError on the next one). Reports: aiohttp#7297, aiohttp#3507 (204
    with keep-alive then closed), aiohttp#2867, python-zyte-api#39 (force_close as the
    workaround)."""

    def closing(header: str) -> Script:
        async def script(req: Received, conn: Conn) -> None:
            await answer(req, conn, {"connection": header})
            conn.close()

        return script

    lying, honest = backends(closing("keep-alive")), backends(closing("close"))
    for b in (lying, honest):
        gw = gateway({"b": b})
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for _ in range(6):
            r = client.chat.completions.create(**CHAT)
            assert r.choices[0].message.content == "ok"
            stream = client.chat.completions.create(**CHAT, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "ok"


def test_client_connection_semantics_are_kept(backends, gateway):
    """The client's own connection: two pipelined requests on one socket get two answers in
    order; ``connection: close`` gets an answer and then the close; ``expect:
    100-continue`` gets ``100 Continue`` before the body is sent, then the answer, and the
    backend never sees ``expect``. Reports: uvicorn#88 / uvicorn#166 (Expect: 100-continue),
    abhinavsingh/proxy.py#124, sentry-native#1967 (a proxy that forwarded Expect and took
    the 100 for the answer), uvicorn#2375 (close when the client must close)."""
    a = backends(answer)
    gw = gateway({"a": a})
    one = post_bytes("/v1/chat/completions", CHAT)
    two = post_bytes("/v1/embeddings", EMBED, b"x-n: 2\r\n")
    data = raw_exchange(gw, one + two, until=b"embedding")
    assert data.count(b"HTTP/1.1 200") == 2, data
    assert data.index(b"chat.completion") < data.index(b"embedding")

    data = raw_exchange(gw, post_bytes("/v1/chat/completions", CHAT, b"connection: close\r\n"))
    assert data.startswith(b"HTTP/1.1 200") and data.rstrip().endswith(b"}"), data
    assert ("connection", "close") in head_of(data)

    raw = json.dumps(CHAT).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                  b"content-type: application/json\r\nexpect: 100-continue\r\n"
                  b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n")
        interim = s.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        s.sendall(raw)
        data = b""
        while not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data
    assert "expect" not in a.data_requests[-1].headers


# ---- header semantics ----------------------------------------------------------------------


@pytest.mark.parametrize("answer_kind", ["json", "chunked-json", "stream", "error"])
def test_length_and_chunked_never_reach_the_client_together(backends, gateway, answer_kind):
    """Whatever framing the backend used (a length, a chunked JSON body, an SSE stream, an
    error), the client gets one framing that matches the bytes: never ``content-length``
    with ``transfer-encoding: chunked``, never the backend's length on a re-framed body.
    Reports: powerproxy-aoai#53, sgl-project/sglang#27523 (router forwarded the worker's
    Content-Length onto a re-wrapped body), radixark/miles#851 (h11 "Too much data for
    declared Content-Length"), braintrust-proxy#1124, cherokee#265, mitmproxy#1033."""

    async def script(req: Received, conn: Conn) -> None:
        if answer_kind == "json":
            await conn.send_json(200, completion_obj("ok"))
        elif answer_kind == "chunked-json":
            body = json.dumps(completion_obj("ok")).encode()
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
            await conn.chunk(body[:10])
            await conn.chunk(body[10:])
            await conn.write(b"0\r\n\r\n")
        elif answer_kind == "stream":
            await answer(req, conn)
        else:
            await conn.send_json(400, {"error": {"message": "bad", "type": "BadRequestError",
                                                 "param": None, "code": 400}})

    a = backends(script)
    gw = gateway({"a": a})
    body = {**CHAT, "stream": answer_kind == "stream"}
    data = raw_exchange(gw, post_bytes("/v1/chat/completions", body,
                                       b"connection: close\r\n"))
    headers = head_of(data)
    names = [k for k, _ in headers]
    assert not ("content-length" in names and "transfer-encoding" in names), headers
    assert names.count("content-length") <= 1 and names.count("transfer-encoding") <= 1
    payload = data.split(b"\r\n\r\n", 1)[1]
    if "content-length" in names:
        assert int(dict(headers)["content-length"]) == len(payload), headers
    else:
        assert ("transfer-encoding", "chunked") in headers
        assert payload.endswith(b"0\r\n\r\n")


def test_repeated_headers_reach_the_other_side_as_repeated(backends, gateway):
    """A backend's repeated header lines (two ``set-cookie``, two ``x-trace``) reach the
    client as two lines, not collapsed or dropped; a client's repeated request header reaches
    the backend with both values. Reports: postmanlabs/httpbin#355 (only the last value of a
    repeated header kept), maximhq/bifrost#3204 (duplicate header lines truncated before
    forwarding), apache/ozone#3500."""

    async def script(req: Received, conn: Conn) -> None:
        body = json.dumps(completion_obj("ok")).encode()
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"set-cookie: a=1\r\nset-cookie: b=2\r\n"
                         b"x-trace: one\r\nx-trace: two\r\n"
                         b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    a = backends(script)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT,
                   headers=[("x-tag", "first"), ("x-tag", "second")], timeout=10)
    assert r.status_code == 200
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert r.headers.get_list("x-trace") == ["one", "two"]
    assert a.data_requests[-1].headers["x-tag"] == "first, second"


def test_client_credentials_and_hop_by_hop_headers_stay_at_the_gateway(backends, gateway):
    """What the client says to the gateway alone never reaches a backend: its
    ``authorization`` and ``proxy-authorization``, ``te``, ``upgrade``, and headers its
    ``connection`` names; the backend gets the gateway's own key. Reports:
    maximhq/bifrost#1867 (passthrough forwarded cookie and proxy-authorization),
    Menci/Floway#96 (inbound content-length forwarded upstream)."""
    a = backends()
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10,
                   headers={"authorization": "Bearer client-secret",
                            "proxy-authorization": "Basic c2VjcmV0",
                            "connection": "keep-alive, x-hop", "x-hop": "1",
                            "te": "trailers", "x-kept": "yes"})
    assert r.status_code == 200
    seen = a.data_requests[-1].headers
    for name in ("proxy-authorization", "x-hop", "te", "upgrade"):
        assert name not in seen, (name, seen)
    assert "client-secret" not in seen.get("authorization", "")
    assert seen["x-kept"] == "yes"
    assert int(seen["content-length"]) == len(a.data_requests[-1].body)


def test_compressed_answer_keeps_its_encoding(backends, gateway):
    """A backend's gzip answer reaches the client as gzip with its ``content-encoding`` (and
    a length that is the compressed one), so the client's decoder gets what the header says;
    a stream asks the backend for ``identity``. Reports: caddyserver/caddy#3546
    (decompressed but kept ``Content-Encoding: gzip``), actix/examples#151,
    joshdick/miniProxy#12, jupyter-server-proxy#288, louketo-proxy#642,
    fine-grained-proxy#18, fpco/http-reverse-proxy#47."""
    plain = json.dumps(completion_obj("zipped")).encode()
    packed = gzip.compress(plain)

    async def script(req: Received, conn: Conn) -> None:
        if req.json().get("stream"):
            await answer(req, conn)
        else:
            await conn.send_response(200, packed, {"content-encoding": "gzip"})

    a = backends(script)
    gw = gateway({"a": a})
    data = raw_exchange(gw, post_bytes("/v1/chat/completions", CHAT,
                                       b"accept-encoding: gzip\r\nconnection: close\r\n"))
    headers = dict(head_of(data))
    assert headers.get("content-encoding") == "gzip", headers
    assert data.split(b"\r\n\r\n", 1)[1] == packed
    assert int(headers["content-length"]) == len(packed)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == "zipped"
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                   headers={"accept-encoding": "gzip"}, timeout=10)
    assert r.status_code == 200
    assert a.data_requests[-1].headers["accept-encoding"] == "identity"


# ---- degenerate answers a backend can send -----------------------------------------------


def test_informational_answers_before_the_real_one_are_skipped(backends, gateway):
    """``100 Continue`` nobody asked for and ``103 Early Hints`` before the final answer are
    provisional: the client gets the final answer, not a 1xx or a hang. Reports:
    aio-libs/aiohttp#1353 (unknown 1xx treated as final), aio-libs/aiohttp#2926 (102 hangs
    the client), snoyberg/http-client#521 (103 early hints), moonbitlang/async#624."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                         b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
        await answer(req, conn)

    a = backends(script)
    gw = gateway({"a": a})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == "ok"
    stream = client.chat.completions.create(**CHAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "ok"


def test_answer_delimited_by_close_is_read_whole(backends, gateway):
    """An HTTP/1.0 answer with neither length nor chunking ends where the backend closes:
    the client gets all of it. Reports: erlang/otp#370 (body ending on close),
    mitre/HTTP-Proxy-Servlet#167."""
    body = json.dumps(completion_obj("x" * 5000)).encode()

    async def script(req: Received, conn: Conn) -> None:
        await conn.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n")
        await conn.write(body[:2000])
        await conn.write(body[2000:])
        conn.close()

    a = backends(script)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200
    assert r.content == body


def test_truncated_answer_is_not_a_success(backends, gateway):
    """A backend that announces ``content-length: N`` and closes after fewer bytes did not
    answer: the client never gets the short body as a 200; with another backend up the
    request is answered there (nothing reached the client yet). Reports:
    psf/requests#4956 (short reads with no error), encode/httpx#643, httpie/cli#965,
    MasterHttpRelayVPN-RUST#48 (truncated Content-Length relay answers treated as whole),
    rawhttp#65."""

    async def short(req: Received, conn: Conn) -> None:
        body = json.dumps(completion_obj("cut")).encode()
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: " + str(len(body) + 50).encode() + b"\r\n\r\n"
                         + body)
        conn.close()

    a = backends(short)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 502, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}

    b = backends()
    gw2 = gateway({"a": a, "b": b})
    client = openai.OpenAI(base_url=gw2.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        assert client.chat.completions.create(**CHAT).choices[0].message.content == "ok"


@pytest.mark.parametrize("value", ["nan", "-5", "1e999", "9" * 5000,
                                   "Wed, 21 Oct 2015 07:28:00 GMT", "soon", "\u00e9"],
                         ids=["nan", "negative", "infinite", "5000-digits", "past-date", "word",
                              "latin-1"])
def test_degenerate_retry_after_still_fails_over(backends, gateway, value):
    """A 429 whose ``Retry-After`` is NaN, negative, infinite, a past date, a word or a
    non-ASCII byte: no crash, the request goes to the other backend, and the cooling stays
    within ``retry.max_cooling_s``. Reports: vm0-ai/vm0#33424 / vm0-ai/vm0#33455 (oversized
    and invalid Retry-After values), BerriAI/litellm#20722 and BerriAI/litellm#5355 (provider
    Retry-After ignored), BerriAI/litellm#30192 (router stuck after a burst of failures)."""

    async def limited(req: Received, conn: Conn) -> None:
        raw = value.encode("latin-1")
        body = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error",
                                     "param": None, "code": 429}}).encode()
        await conn.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                         b"retry-after: " + raw + b"\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)

    a, b = backends(limited), backends()
    gw = gateway({"a": a, "b": b})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        assert client.chat.completions.create(**CHAT).choices[0].message.content == "ok"
    rows = httpx.get(gw.url + "/admin/backends", timeout=5).json()["backends"]
    row = next(r for r in rows if r["id"] == "a")
    assert 0 <= row["cooling_for_s"] <= 60, row


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_degenerate_usage_numbers_are_not_counted(backends, gateway, stream):
    """A backend's ``usage`` with negative, NaN, fractional or absurd token counts: the
    answer reaches the client unchanged, and ``gateway_tokens_total`` never goes backwards,
    never becomes NaN and does not take the absurd number. Reports: BerriAI/litellm#12970
    (inflated prompt tokens), songquanpeng/one-api#1391 (usage present with empty values),
    bestruirui/octopus#208 (200 with all-zero usage and no content)."""
    usage = (b'{"prompt_tokens": ' + str(10**30).encode()
             + b', "completion_tokens": -7, "total_tokens": NaN, "cached_tokens": 1e400}')

    async def script(req: Received, conn: Conn) -> None:
        if stream:
            await conn.start_stream()
            await conn.event(chunk_obj(role="assistant", content="ok"))
            await conn.event(chunk_obj(finish="stop"))
            await conn.event(b'{"id": "c", "object": "chat.completion.chunk", "created": 1, '
                             b'"model": "m1", "choices": [], "usage": ' + usage + b"}")
            await conn.done()
        else:
            body = (b'{"id": "c", "object": "chat.completion", "created": 1, "model": "m1", '
                    b'"choices": [{"index": 0, "message": {"role": "assistant", '
                    b'"content": "ok"}, "finish_reason": "stop"}], "usage": ' + usage + b"}")
            await conn.send_response(200, body)

    a = backends(script)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
    assert r.status_code == 200
    assert usage in r.content
    counted = tokens_counted(gw)
    for kind in ("prompt", "completion"):
        v = counted.get(kind, 0.0)
        assert v == v and 0 <= v < 1e9, counted


def test_non_finite_backend_gauges_read_as_no_load(backends, gateway):
    """A backend whose ``/metrics`` says ``-nan`` or ``+Inf`` for some gauges (an exporter
    before its first request, a division by zero) still has a usable load sample: the
    finite gauges as sent, the others as no load, finite numbers in
    ``/admin/backends`` and in the gateway's own gauges, the backend warm and answering.
    Reports: ggml-org/llama.cpp#11868 (metrics return ``-nan``),
    kubernetes-sigs/gateway-api-inference-extension#2900 and llm-d/llm-d-router#926 (the
    endpoint picker failed when a vLLM metric family was missing)."""

    async def control(req: Received, conn: Conn) -> None:
        if req.path == "/metrics":
            await conn.send_response(200, b'vllm:num_requests_running{engine="0"} -nan\n'
                                          b'vllm:num_requests_waiting{engine="0"} 2.0\n'
                                          b'vllm:kv_cache_usage_perc{engine="0"} +Inf\n',
                                     content_type="text/plain")
        else:
            await default_script(req, conn)

    a = backends(answer, control=control)
    gw = gateway({"a": a})

    def row() -> dict[str, Any]:
        rows = httpx.get(gw.url + "/admin/backends", timeout=5).json()["backends"]
        return next(r for r in rows if r["id"] == "a")

    assert wait_for(lambda: row()["last_scrape_age_s"] is not None), row()
    load = row()["load"]
    assert load is not None and load["waiting"] == 2.0, load
    assert all(
        isinstance(load[k], (int, float)) and 0 <= load[k] < 1e9
        for k in ("waiting", "running", "kv_cache_usage")), load
    assert row()["state"] == "warm"
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.startswith("gateway_backend_") and sample.labels.get("backend") == "a":
                assert sample.value == sample.value and abs(sample.value) != float("inf"), sample
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content == "ok"


def test_usage_on_a_final_chunk_with_choices_is_counted(backends, gateway):
    """Usage that arrives on the stream's last chunk together with a non-empty ``choices``
    (finish_reason and usage in one chunk, as several OpenAI-compatible servers send it) is
    counted like a usage-only chunk. Reports: BerriAI/litellm#36168 (usage dropped when the
    final chunk has non-empty choices), BerriAI/litellm#36083, BerriAI/litellm#8349 (zero
    usage on streamed completions), envoyproxy/ai-gateway#2290."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content="ok"))
        last = chunk_obj(finish="stop")
        last["usage"] = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
                         "prompt_tokens_details": {"cached_tokens": 8}}
        await conn.event(last)
        await conn.done()

    a = backends(script)
    gw = gateway({"a": a})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 11
    assert wait_for(lambda: tokens_counted(gw).get("prompt") == 11.0), tokens_counted(gw)
    assert tokens_counted(gw).get("completion") == 5.0


# ---- answers that are not what their status says ------------------------------------------


def test_error_answer_without_content_type_keeps_its_status(backends, gateway):
    """A backend's 4xx without a ``content-type`` (or with one that lies) is still that 4xx
    with its own body for the client, not a gateway 502. Reports: mlflow/mlflow#23680
    (non-2xx without Content-Type masked as 502), kortix-ai/suna#5986 (upstream 400 surfaced
    as a generic Bad Gateway), Portkey-AI/gateway#722 (error body that was not JSON broke
    the gateway)."""
    bodies = {"/v1/chat/completions": b"model is not allowed here",
              "/v1/embeddings": b"<html><body>403 Forbidden</body></html>"}

    async def script(req: Received, conn: Conn) -> None:
        raw = bodies[req.path]
        ctype = "" if req.path == "/v1/chat/completions" else "content-type: application/json\r\n"
        status = b"400 Bad Request" if req.path == "/v1/chat/completions" else b"403 Forbidden"
        await conn.write(b"HTTP/1.1 " + status + b"\r\n" + ctype.encode()
                         + b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)

    a = backends(script)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert (r.status_code, r.content) == (400, bodies["/v1/chat/completions"])
    r = httpx.post(gw.url + "/v1/embeddings", json=EMBED, timeout=10)
    assert (r.status_code, r.content) == (403, bodies["/v1/embeddings"])


@pytest.mark.parametrize("body", [b"", b"<html><body>upstream is sleeping</body></html>",
                                  b"\xff\xfe not utf-8"],
                         ids=["empty", "html", "not-utf8"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
def test_success_status_without_an_answer_is_a_backend_failure(backends, gateway, body, path,
                                                               batcher):
    """A 200 to a JSON endpoint whose body is empty, HTML or not even UTF-8 is no answer: the
    client must not get it as a success; the request goes to another backend and the client
    gets that one's answer. Reports: hugalafutro/model-hotel#821 (a 2xx that did not carry a
    completion became 502), decolua/9router#3051 (empty 200 recorded as success),
    bestruirui/octopus#208 (empty-content 200 retried on another upstream),
    gravitee-io/issues#4982 (200 with empty body)."""

    async def broken(req: Received, conn: Conn) -> None:
        await conn.send_response(200, body)

    a, b = backends(broken), backends(answer)
    sections: dict[str, Any] = {"batcher": {"enabled": True}} if batcher else {}
    gw = gateway({"a": a, "b": b}, **sections)
    payload = CHAT if path == "/v1/chat/completions" else EMBED
    for _ in range(4):
        r = httpx.post(gw.url + path, json=payload, timeout=10)
        assert r.status_code == 200 and r.content != body, (r.status_code, r.content)
        assert "error" not in r.json(), r.text



# (path, body) of every JSON route, streaming and not
JSON_ROUTES = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-stream": ("/v1/chat/completions", {**CHAT, "stream": True}),
    "completions": ("/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 4}),
    "embeddings": ("/v1/embeddings", EMBED),
    "responses": ("/v1/responses", {"model": "m1", "input": "hi"}),
    "responses-stream": ("/v1/responses", {"model": "m1", "input": "hi", "stream": True}),
}


@pytest.mark.parametrize("status", [204, 201, 202])
@pytest.mark.parametrize("route", list(JSON_ROUTES))
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
def test_success_status_without_an_answer_is_a_backend_failure_for_every_2xx(
    backends, gateway, status, route, batcher
):
    """Not only a 200: any 2xx with an empty body (a 204 No Content, a 202 Accepted) on a
    route whose answer is a JSON object is no answer; the request goes to the other backend
    and the client gets that one's answer (tryout exp11b: a 204 reached a chat client)."""

    async def empty(req: Received, conn: Conn) -> None:
        await conn.write(f"HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n".encode())

    a, b = backends(empty), backends(answer)
    sections: dict[str, Any] = {"batcher": {"enabled": True}} if batcher else {}
    gw = gateway({"a": a, "b": b}, **sections)
    path, body = JSON_ROUTES[route]
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for _ in range(3):
            r = client.post(path, json=body)
            assert r.status_code == 200 and r.content, (r.status_code, r.content)
            assert "error" not in r.text, r.text
    assert a.data_requests  # a was asked, and its empty 2xx never reached the client


@pytest.mark.parametrize("route", ["chat", "completions", "embeddings", "responses"])
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
def test_success_status_with_a_byte_order_mark_is_an_answer(backends, gateway, route, batcher):
    """A JSON answer that starts with a UTF-8 byte order mark is JSON (RFC 8259 section 8.1:
    a parser may ignore it; Python's ``json``, httpx and the SDKs do): it reaches the client
    as an answer, never a 502 (tryout exp11b: it became one)."""

    async def with_bom(req: Received, conn: Conn) -> None:
        obj = {"/v1/chat/completions": completion_obj("ok"), "/v1/completions": COMPLETION,
               "/v1/embeddings": EMBEDDING, "/v1/responses": RESPONSE}[req.path]
        await conn.send_response(200, b"\xef\xbb\xbf" + json.dumps(obj).encode(),
                                 {"content-type": "application/json"})

    a = backends(with_bom)
    sections: dict[str, Any] = {"batcher": {"enabled": True}} if batcher else {}
    gw = gateway({"a": a}, **sections)
    path, body = JSON_ROUTES[route]
    r = httpx.post(gw.url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert "error" not in r.json(), r.text
    if route == "chat":
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(**CHAT).choices[0].message.content == "ok"


def test_success_status_without_an_answer_alone_is_an_openai_shaped_502(backends, gateway):
    """The only backend answers 200 with an HTML page: the client gets the gateway's 502 in
    OpenAI's error shape (an SDK raises it, and may retry), counted as a ``bad_answer``
    attempt, never a 200 it cannot read."""

    async def broken(req: Received, conn: Conn) -> None:
        await conn.send_response(200, b"<html><body>upstream is sleeping</body></html>")

    a = backends(broken)
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "upstream_unavailable" and "without a JSON body" in err["message"]
    attempts = gw.gateway.metrics.upstream_attempts
    assert attempts.labels("a", "bad_answer")._value.get() == 1
