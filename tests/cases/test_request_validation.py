"""What the gateway does with the request itself: client mistakes get an OpenAI-shaped 4xx
that SDKs do not retry (never a 5xx), and large bodies are forwarded byte for byte up to a
documented limit, beyond which a clear 413 is answered (cases BUG-07, BUG-24)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import (
    Conn,
    Received,
    ScriptedBackend,
    chunk_obj,
    completion_obj,
    default_script,
    read_json_answer,
)
from tests.support.servers import GatewayThread, gateway_config

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
MiB = 1024 * 1024


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """``r`` is an OpenAI-shaped JSON error with ``status`` and no retry hint; its object."""
    assert r.status_code == status, (r.status_code, r.headers, r.text[:500])
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    body = r.json()  # not empty, not HTML
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str | int), err
    assert "retry-after" not in r.headers and "retry-after-ms" not in r.headers, r.headers
    return err  # type: ignore[no-any-return]


# ---- BUG-07 --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet07() -> Iterator[tuple[GatewayThread, ScriptedBackend, ScriptedBackend]]:
    """One gateway over A and B (both serve m1, both record hits) for every BUG-07 case."""
    a, b = ScriptedBackend(default_script), ScriptedBackend(default_script)
    a.start()
    b.start()
    gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}, {"id": "b", "url": b.url}]))
    try:
        gw.start()
        gw.wait_ready(routable=2)
        yield gw, a, b
    finally:
        gw.stop()
        a.stop()
        b.stop()


HI = [{"role": "user", "content": "hi"}]

# (id, method, path, body bytes or None, expected status, expected code or None)
CASE_MISTAKES = [
    ("1_truncated_json", "POST", "/v1/chat/completions", b'{"model":"m1","messages":', 400, None),
    ("2_no_messages", "POST", "/v1/chat/completions", b'{"model":"m1"}', 400, None),
    ("3_unknown_model", "POST", "/v1/chat/completions",
     json.dumps({"model": "no-such-model", "messages": HI}).encode(), 404, "model_not_found"),
    ("4_wrong_method", "GET", "/v1/chat/completions", None, 405, None),
    ("5_unknown_route", "POST", "/v1/does-not-exist", json.dumps(BODY).encode(), 404, None),
]
# The rest of the kind: other malformed or unroutable requests a client can send.
MORE_MISTAKES = [
    ("empty_body", "POST", "/v1/chat/completions", b"", 400, None),
    ("json_array", "POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("not_utf8", "POST", "/v1/chat/completions", b'{"model":"m1","messages":"\xff\xfe"}', 400,
     None),
    ("no_model", "POST", "/v1/chat/completions", json.dumps({"messages": HI}).encode(), 400, None),
    ("model_not_string", "POST", "/v1/chat/completions",
     json.dumps({"model": 7, "messages": HI}).encode(), 400, None),
    ("stream_not_bool", "POST", "/v1/chat/completions",
     json.dumps({**BODY, "stream": "yes"}).encode(), 400, None),
    ("completions_no_prompt", "POST", "/v1/completions", b'{"model":"m1"}', 400, None),
    ("embeddings_no_input", "POST", "/v1/embeddings", b'{"model":"m1"}', 400, None),
    ("completions_unknown_model", "POST", "/v1/completions",
     b'{"model":"no-such-model","prompt":"hi"}', 404, "model_not_found"),
    ("get_unknown_model_card", "GET", "/v1/models/no-such-model", None, 404, "model_not_found"),
    ("put_models", "PUT", "/v1/models", None, 405, None),
    # valid-looking JSON nested deeper than any parser's recursion limit (200 kB)
    ("deeply_nested_json", "POST", "/v1/chat/completions",
     b'{"model":"m1","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
]


@pytest.mark.parametrize(
    "case", CASE_MISTAKES + MORE_MISTAKES, ids=[c[0] for c in CASE_MISTAKES + MORE_MISTAKES]
)
def test_BUG_07_client_mistake_gets_4xx(fleet07, case):
    """BUG-07 repro 1-5 (plus more of the same kind), raw HTTP: the status OpenAI/vLLM use,
    OpenAI error shape, JSON, no Retry-After, and no backend is contacted (the gateway
    validates, so case 2 is not forwarded either)."""
    gw, a, b = fleet07
    _, method, path, body, status, code = case
    before = len(a.data_requests) + len(b.data_requests)
    r = httpx.request(method, gw.url + path, content=body,
                      headers={"content-type": "application/json",
                               "authorization": "Bearer CLIENT_KEY"}, timeout=10)
    err = assert_openai_error(r, status)
    if code is not None:
        assert err["code"] == code
    if status == 404 and code == "model_not_found":
        assert err["param"] == "model"
    assert len(a.data_requests) + len(b.data_requests) == before


def _counting_client(url: str) -> tuple[openai.OpenAI, list[str]]:
    """An SDK client with its default retries (max_retries=2) that records each HTTP request."""
    sent: list[str] = []
    http = openai.DefaultHttpx2Client(
        event_hooks={"request": [lambda req: sent.append(f"{req.method} {req.url.path}")]})
    return openai.OpenAI(base_url=url + "/v1", api_key="CLIENT_KEY", http_client=http), sent


def test_BUG_07_sdk_sends_each_mistake_once(fleet07):
    """BUG-07, "with openai-python (default max_retries=2) each call results in exactly 1 HTTP
    request to GW": the SDK retries 408/409/429/5xx, so one request per call proves the
    gateway answered a non-retryable 4xx; the exception class is the 4xx one."""
    gw, a, b = fleet07
    client, sent = _counting_client(gw.url)
    assert client.max_retries == 2
    json_h = {"headers": {"content-type": "application/json"}}
    calls = [
        ("1", openai.BadRequestError, lambda: client.post(
            "/chat/completions", cast_to=object, content=b'{"model":"m1","messages":',
            options=json_h)),
        ("2", openai.BadRequestError, lambda: client.post(
            "/chat/completions", cast_to=object, body={"model": "m1"})),
        ("3", openai.NotFoundError, lambda: client.chat.completions.create(
            model="no-such-model", messages=HI)),
        ("4", openai.APIStatusError, lambda: client.get("/chat/completions", cast_to=object)),
        ("5", openai.NotFoundError, lambda: client.post(
            "/does-not-exist", cast_to=object, body=BODY)),
        ("models.retrieve", openai.NotFoundError, lambda: client.models.retrieve("no-such-model")),
        ("deeply_nested_json", openai.BadRequestError, lambda: client.post(
            "/chat/completions", cast_to=object, options=json_h,
            content=b'{"model":"m1","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
    ]
    before = len(a.data_requests) + len(b.data_requests)
    wrong = []
    for name, exc, call in calls:
        sent.clear()
        try:
            call()
            wrong.append((name, "no error"))
        except openai.APIStatusError as e:
            if not isinstance(e, exc) or not 400 <= e.status_code < 500 or len(sent) != 1:
                wrong.append((name, e.status_code, f"{len(sent)} HTTP requests"))
    assert not wrong, wrong
    assert len(a.data_requests) + len(b.data_requests) == before


def test_BUG_07_unknown_model_is_404_not_401_with_client_keys(backends, gateway):
    """BUG-07 related report (#2112): with client keys configured, a valid key and an unknown
    model must get 404 ``model_not_found``, not a misleading 401; a missing key still gets
    401 (that one is the client's auth mistake)."""
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "c", "key": "CLIENT_KEY"}]})
    bad_model = {"model": "no-such-model", "messages": HI}
    r = httpx.post(gw.url + "/v1/chat/completions", json=bad_model,
                   headers={"authorization": "Bearer CLIENT_KEY"}, timeout=10)
    assert assert_openai_error(r, 404)["code"] == "model_not_found"
    r = httpx.post(gw.url + "/v1/chat/completions", json=bad_model, timeout=10)
    assert_openai_error(r, 401)
    assert not a.data_requests


# ---- BUG-24 --------------------------------------------------------------------------------

def _echo_digest(req: Received) -> str:
    return f"{len(req.body)}:{hashlib.sha256(req.body).hexdigest()}"


async def digest_script(req: Received, conn: Conn) -> None:
    """Answers with the length and SHA-256 of the body it received (stream or not)."""
    if req.json().get("stream"):
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content=""))
        await conn.event(chunk_obj(content=_echo_digest(req)))
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()
    else:
        await conn.send_json(200, completion_obj(_echo_digest(req)))


def _digest(data: bytes) -> str:
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"


def multimodal_body(image_bytes: int) -> bytes:
    """BUG-24 repro 1: a text part and 3 ``data:image/png;base64,...`` parts."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these three images."}]
    for _ in range(3):
        b64 = base64.b64encode(os.urandom(image_bytes)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}})
    return json.dumps({"model": "m1", "messages": [{"role": "user", "content": parts}],
                       "max_tokens": 64}).encode()


def sized_body(size: int) -> bytes:
    """A valid chat body of exactly ``size`` bytes."""
    head = json.dumps({**BODY, "messages": [{"role": "user", "content": ""}]}).encode()
    pad = size - len(head)
    assert pad >= 0
    body = json.dumps({**BODY, "messages": [{"role": "user", "content": "x" * pad}]}).encode()
    assert len(body) == size
    return body


def test_BUG_24_12MiB_multimodal_body_forwarded_intact(backends, gateway):
    """BUG-24 repro 1 with the gateway's default ``server.max_body_bytes``: a ~12 MiB body
    (3 base64 images of ~4 MiB) reaches A with the same length and SHA-256, and the client
    gets A's answer (which names that digest)."""
    a = backends(digest_script)
    gw = gateway({"a": a})
    body = multimodal_body(3 * MiB)  # 3 MiB raw -> 4 MiB base64 each
    assert 12 * MiB <= len(body) < 13 * MiB
    r = httpx.post(gw.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"] == _digest(body)
    assert len(a.data_requests) == 1
    assert _digest(a.data_requests[0].body) == _digest(body)


def test_BUG_24_200k_char_prompt_streams(backends, gateway):
    """BUG-24 repro 3: a 200k-character prompt (multi-byte UTF-8 sent raw, so characters !=
    bytes), streaming; A receives the exact bytes (but for ``return_token_ids``, which the
    gateway adds to a chat stream with continuation on, issue 17: the body re-serialized,
    every character kept) and the client gets A's stream to [DONE]."""
    a = backends(digest_script)
    gw = gateway({"a": a})
    text = ("Grüße, 漢字 and plain words. " * 8000)[:200_000]
    body = json.dumps({**BODY, "stream": True, "messages": [{"role": "user", "content": text}]},
                      ensure_ascii=False).encode()
    with httpx.stream("POST", gw.url + "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=30) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    sent = json.dumps({**json.loads(body), "return_token_ids": True},
                      ensure_ascii=False).encode()
    assert _digest(a.data_requests[0].body) == _digest(sent)
    assert json.dumps(chunk_obj(content=_digest(sent))).encode() in raw
    assert raw.endswith(b"data: [DONE]\n\n")


LIMIT = 1 * MiB


def _assert_413(r: httpx.Response, limit: int) -> None:
    err = assert_openai_error(r, 413)
    assert err["type"] == "invalid_request_error"
    assert str(limit) in err["message"], err  # the message names the limit


def test_BUG_24_over_limit_gets_413(backends, gateway):
    """BUG-24 repro 2, scaled: ``server.max_body_bytes`` = 1 MiB (instead of the default
    64 MiB) to keep it fast. A body of exactly the limit passes intact; limit + 1 MiB gets a
    413 in OpenAI shape naming the limit, with the request id, whether the client declared a
    Content-Length or streamed it chunked; A receives nothing; the SDK does not retry it."""
    a = backends(digest_script)
    gw = gateway({"a": a}, server={"max_body_bytes": LIMIT})
    exact = sized_body(LIMIT)
    r = httpx.post(gw.url + "/v1/chat/completions", content=exact,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert _digest(a.data_requests[0].body) == _digest(exact)

    over = sized_body(LIMIT + MiB)
    r = httpx.post(gw.url + "/v1/chat/completions", content=over,
                   headers={"content-type": "application/json", "x-request-id": "big-1"},
                   timeout=30)
    _assert_413(r, LIMIT)
    assert r.headers.get("x-request-id") == "big-1"

    def chunked() -> Iterator[bytes]:
        for i in range(0, len(over), 64 * 1024):
            yield over[i:i + 64 * 1024]

    r = httpx.post(gw.url + "/v1/chat/completions", content=chunked(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in r.request.headers
    _assert_413(r, LIMIT)

    client, sent = _counting_client(gw.url)
    with pytest.raises(openai.APIStatusError) as info:
        client.post("/chat/completions", cast_to=object, content=over,
                    options={"headers": {"content-type": "application/json"}})
    assert info.value.status_code == 413
    assert len(sent) == 1  # not retried: the client's session is not broken by retries
    assert len(a.data_requests) == 1  # only the at-limit body reached A


def test_BUG_24_over_default_limit_gets_413(backends, gateway):
    """BUG-24 repro 2 with the production default limit (64 MiB): limit + 1 MiB -> 413."""
    a = backends(digest_script)
    gw = gateway({"a": a})
    limit = gw.cfg.server.max_body_bytes
    assert limit >= 12 * MiB  # not lower than what multimodal requests need (repro 1)
    r = httpx.post(gw.url + "/v1/chat/completions", content=sized_body(limit + MiB),
                   headers={"content-type": "application/json"}, timeout=60)
    _assert_413(r, limit)
    assert not a.data_requests


def test_BUG_24_over_limit_is_logged_with_request_id(backends, gateway, caplog):
    """BUG-24 expected: the 413 is "logged with the request id" (the reported proxy rejected
    before any handler or log ran, so nobody could tell why sessions broke). An operator must
    find a log record naming the request id of the refused request."""
    a = backends(digest_script)
    gw = gateway({"a": a}, server={"max_body_bytes": LIMIT})
    caplog.set_level(logging.INFO)
    r = httpx.post(gw.url + "/v1/chat/completions", content=sized_body(LIMIT + MiB),
                   headers={"content-type": "application/json",
                            "x-request-id": "req-413-logged"}, timeout=30)
    _assert_413(r, LIMIT)
    logged = [rec for rec in caplog.records if "req-413-logged" in rec.getMessage()]
    assert logged, "no log record names the request id of the 413"


def test_stalled_request_body_gets_408_not_a_hang(backends, gateway):
    """A client that sends the headers and part of its body, then nothing: after
    ``server.body_idle_timeout_s`` (1 s here) it gets a 408 in OpenAI's shape and the
    backend never sees the request (slowloris protection); a slow but steady upload is
    not cut."""
    import socket as _socket

    a = backends()
    gw = gateway({"a": a}, server={"body_idle_timeout_s": 1.0})
    host, port = gw.url.removeprefix("http://").split(":")
    s = _socket.create_connection((host, int(port)), timeout=5)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        data = read_json_answer(s, 4096)
        assert time.monotonic() - t0 < 4
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert a.data_requests == []

    s = _socket.create_connection((host, int(port)), timeout=5)
    try:  # 6 pieces, 0.3 s apart (1.5 s from the first to the last): slower in total than
        # the idle timeout, each gap under a third of it
        payload = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
        raw = payload.encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: " + str(len(raw)).encode() + b"\r\n\r\n")
        step = -(-len(raw) // 6)
        pieces = [raw[i:i + step] for i in range(0, len(raw), step)]
        assert len(pieces) == 6
        started = time.monotonic()
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(0.3)
            s.sendall(piece)
        assert time.monotonic() - started > 1.0  # the upload outlasted the idle timeout
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        s.close()
