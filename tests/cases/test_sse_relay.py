"""How the gateway relays an event stream to clients: never held back by compression, hop-
by-hop headers dropped, compressed non-stream bodies kept consistent with their headers
(case BUG-13); and SSE framing exactly as OpenAI clients expect: ``data: <json>\\n\\n``, LF
only, payloads byte-identical, no pings a client could mistake for data (case BUG-15)."""

from __future__ import annotations

import gzip
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from tests.support.rawclient import RawClient
from tests.support.scripted import Conn, Received, chunk_obj, completion_obj

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}

# Hop-by-hop headers a backend may send; none of them may reach the client.
A_HOP_HEADERS = {"connection": "keep-alive, x-a-hop", "keep-alive": "timeout=77, max=99",
                 "x-a-hop": "only-for-this-hop"}


def assert_no_hop_headers_from_a(headers: httpx.Headers) -> None:
    assert "keep-alive" not in headers, headers
    assert "x-a-hop" not in headers, headers
    assert "x-a-hop" not in headers.get("connection", ""), headers
    assert len(headers.get_list("transfer-encoding")) <= 1, headers


# ---- BUG-13 --------------------------------------------------------------------------------

N_EVENTS = 8
GAP_S = 0.5  # scaled from the case's 1 s; an event held back shows up as >= GAP_S late


def test_BUG_13_compression_never_buffers_event_stream(backends, gateway):
    """BUG-13 first check, scaled to 8 events 0.5 s apart (case: 10 events 1 s apart, event k
    at k s +- 0.5 s). Two clients at once: httpx asking ``Accept-Encoding: gzip, deflate,
    br`` and the openai SDK (which asks for gzip by default). Each event must reach the
    client within 0.3 s of A writing it (measured against A's own write times, same clock),
    so no compressor holds events back; whatever ``Content-Encoding`` the stream carries, the
    client decodes it event by event. A's hop-by-hop headers are not copied."""
    written: dict[str, list[float]] = {}

    async def script(req: Received, conn: Conn) -> None:
        times = written.setdefault(req.headers.get("x-request-id", "?"), [])
        await conn.start_stream(headers=A_HOP_HEADERS)
        for i in range(N_EVENTS):
            if i and not await conn.sleep(GAP_S):
                return
            await conn.event(chunk_obj(content=f"e{i}", role="assistant" if i == 0 else None))
            times.append(time.monotonic())
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()

    a = backends(script)
    gw = gateway({"a": a})

    def raw_client() -> tuple[list[float], httpx.Headers]:
        arrived: list[float] = []
        buf = b""
        with httpx.stream("POST", gw.url + "/v1/chat/completions",
                          json={**BODY, "stream": True}, timeout=30,
                          headers={"accept-encoding": "gzip, deflate, br",
                                   "x-request-id": "raw"}) as r:
            assert r.status_code == 200
            for data in r.iter_bytes():  # decoded incrementally, whatever the encoding
                buf += data
                while len(arrived) < N_EVENTS and f'"e{len(arrived)}"'.encode() in buf:
                    arrived.append(time.monotonic())
            return arrived, r.headers

    def sdk_client() -> list[float]:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        arrived = []
        for ch in client.chat.completions.create(**{**BODY, "stream": True},
                                                 extra_headers={"x-request-id": "sdk"}):
            if ch.choices and ch.choices[0].delta.content:
                assert ch.choices[0].delta.content == f"e{len(arrived)}"
                arrived.append(time.monotonic())
        return arrived

    with ThreadPoolExecutor(2) as ex:
        f_raw, f_sdk = ex.submit(raw_client), ex.submit(sdk_client)
        raw_arrived, headers = f_raw.result(timeout=30)
        sdk_arrived = f_sdk.result(timeout=30)
    assert headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in headers
    assert_no_hop_headers_from_a(headers)
    for who, arrived in (("raw", raw_arrived), ("sdk", sdk_arrived)):
        sent = written[who]
        assert len(arrived) == len(sent) == N_EVENTS, (who, arrived, sent)
        lags = [round(got - w, 3) for got, w in zip(arrived, sent, strict=True)]
        assert max(lags) < 0.3, (who, lags)


def _read_http_response(c: RawClient) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, header list and body (Content-Length or chunked) from a raw socket."""
    c.read_until(b"\r\n\r\n")
    head = c.buf.split(b"\r\n\r\n", 1)[0]
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k.strip().lower(), v.strip()) for k, v in
               (line.split(":", 1) for line in lines[1:])]
    h = dict(headers)
    if "content-length" in h:
        n = int(h["content-length"])
        deadline = time.monotonic() + 10
        while len(c.buf) - len(head) - 4 < n:
            assert time.monotonic() < deadline, c.buf
            c.read_for(0.2)
        return status, headers, c.buf[len(head) + 4:][:n]
    assert h.get("transfer-encoding") == "chunked", headers
    c.read_until(b"\r\n0\r\n\r\n")
    body, data = b"", c.buf[len(head) + 4:]
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return status, headers, body
        body, data = body + data[:size], data[size + 2:]


def test_BUG_13_backend_gzip_non_stream_decodes(backends, gateway):
    """BUG-13 second check: A replies to a non-stream request with a gzip body
    (``Content-Encoding: gzip``, its compressed ``Content-Length``) plus hop-by-hop headers.
    The client's body must match its headers: gzip bytes with ``content-encoding: gzip`` and a
    correct ``content-length`` (or decoded bytes without that header), never decoded bytes
    under a gzip header; raw socket, httpx and the openai SDK all get the right JSON."""
    answer = json.dumps(completion_obj("compressed hello")).encode()
    packed = gzip.compress(answer)

    async def script(req: Received, conn: Conn) -> None:
        await conn.send_response(200, packed, headers={"content-encoding": "gzip",
                                                       **A_HOP_HEADERS})

    a = backends(script)
    gw = gateway({"a": a})
    c = RawClient(gw.url)
    c.send("POST", "/v1/chat/completions", BODY, headers={"accept-encoding": "gzip, deflate"})
    status, headers, body = _read_http_response(c)
    c.close()
    assert status == 200
    names = [k for k, _ in headers]
    h = dict(headers)
    assert names.count("content-encoding") <= 1 and names.count("content-length") <= 1
    if h.get("content-encoding") == "gzip":
        assert gzip.decompress(body) == answer
    else:
        assert "content-encoding" not in h and body == answer
    if "content-length" in h:
        assert int(h["content-length"]) == len(body)
        assert "transfer-encoding" not in h
    assert "keep-alive" not in h and "x-a-hop" not in h
    assert "x-a-hop" not in h.get("connection", "")

    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10,
                   headers={"accept-encoding": "gzip, deflate, br"})
    assert r.status_code == 200 and r.json() == json.loads(answer)
    assert_no_hop_headers_from_a(r.headers)

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    got = client.chat.completions.create(**BODY)
    assert got.choices[0].message.content == "compressed hello"


# ---- BUG-15 --------------------------------------------------------------------------------

USAGE = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1,
         "model": "m1", "choices": [],
         "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def stream_payloads(content: list[str]) -> list[bytes]:
    """A's event payloads: role chunk, content chunks, finish, usage chunk, [DONE]."""
    objs: list[Any] = [chunk_obj(role="assistant", content="")]
    objs += [chunk_obj(content=t) for t in content]
    objs += [chunk_obj(finish="stop"), USAGE]
    return [json.dumps(o).encode() for o in objs] + [b"[DONE]"]


def lf_form(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def strict_lf_events(raw: bytes) -> list[bytes]:
    """A strict LF-only SSE parser: returns the ``data:`` payloads; every block must be one
    ``data: `` line (no ``event:``/``id:``/``retry:``, no ``data: data:``) or a ``:`` comment."""
    assert b"\r" not in raw, "CR in the gateway's framing"
    assert raw.endswith(b"\n\n"), raw[-50:]
    out = []
    for block in raw[:-2].split(b"\n\n"):
        lines = block.split(b"\n")
        if all(line.startswith(b":") for line in lines):
            continue  # a keep-alive comment: allowed, ignored
        assert len(lines) == 1 and lines[0].startswith(b"data: "), block[:200]
        assert not lines[0].startswith(b"data: data:"), block[:200]
        out.append(lines[0][len(b"data: "):])
    assert out.count(b"[DONE]") == 1 and out[-1] == b"[DONE]"
    return out


def content_of(payloads: list[bytes]) -> str:
    text = ""
    for p in payloads[:-1]:
        obj = json.loads(p)
        assert "error" not in obj, obj
        if obj["choices"]:
            text += obj["choices"][0]["delta"].get("content") or ""
    return text


def framing_script(sep: bytes, split_at: int, silence_s: float = 0.0, content=("a", "b", "c")):
    """Streams :func:`stream_payloads` with separator ``sep``; the bytes go out in HTTP chunks
    of ``split_at`` bytes (cutting events, and CRLFs, at arbitrary points), after an initial
    silence of ``silence_s``."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        if silence_s and not await conn.sleep(silence_s):
            return
        data = b"".join(b"data: " + p + sep for p in stream_payloads(list(content)))
        for i in range(0, len(data), split_at):
            if not await conn.chunk(data[i:i + split_at]):
                return
            await conn.sleep(0.002)
        await conn.write(b"0\r\n\r\n")

    return script


def capture(url: str) -> tuple[httpx.Headers, bytes]:
    """The gateway's raw event-stream bytes (no content decoding asked)."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True},
                      headers={"accept-encoding": "identity"}, timeout=60) as r:
        assert r.status_code == 200
        return r.headers, b"".join(r.iter_raw())


def sdk_content(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return "".join(ch.choices[0].delta.content or "" for ch in
                   client.chat.completions.create(**{**BODY, "stream": True}) if ch.choices)


def test_BUG_15_lf_stream_relayed_byte_identical(backends, gateway):
    """BUG-15 main repro: A streams 3 content chunks + finish + usage chunk + ``[DONE]`` with
    LF framing, cut into 7-byte HTTP chunks. The client's bytes are exactly A's events
    (``data: <payload>\\n\\n``, LF only, no added fields, one ``[DONE]``), and the SDK and a
    strict LF-only parser reconstruct the same content."""
    a = backends(framing_script(b"\n\n", 7))
    gw = gateway({"a": a})
    headers, raw = capture(gw.url)
    assert headers["content-type"].startswith("text/event-stream")
    expected = stream_payloads(["a", "b", "c"])
    assert raw == lf_form(expected)
    assert strict_lf_events(raw) == expected
    assert content_of(expected) == sdk_content(gw.url) == "abc"


def test_BUG_15_crlf_upstream_reemitted_as_lf(backends, gateway):
    """BUG-15 CRLF variant: A frames events with ``\\r\\n\\r\\n`` and its HTTP chunks (5 bytes)
    split CRLF pairs. The gateway accepts it and re-emits the canonical LF form (the project's
    decision in DESIGN.md: LF only toward clients), payloads unchanged."""
    a = backends(framing_script(b"\r\n\r\n", 5))
    gw = gateway({"a": a})
    _, raw = capture(gw.url)
    expected = stream_payloads(["a", "b", "c"])
    assert raw == lf_form(expected)
    assert content_of(strict_lf_events(raw)) == sdk_content(gw.url) == "abc"


def test_BUG_15_large_events_not_lost_or_merged(backends, gateway):
    """BUG-15 "Must NOT: lost or merged events when a payload is large": content chunks of
    100 KiB and 300 KiB (beyond 64 KiB buffers) between small ones, sent in 7000-byte HTTP
    chunks. The client's bytes are exactly A's events; SDK content matches."""
    big = ["x" * 100 * 1024, "s", "y" * 300 * 1024, "t"]
    a = backends(framing_script(b"\n\n", 7000, content=big))
    gw = gateway({"a": a})
    _, raw = capture(gw.url)
    expected = stream_payloads(big)
    assert raw == lf_form(expected)
    assert strict_lf_events(raw) == expected
    assert sdk_content(gw.url) == "".join(big)


def test_BUG_15_silence_gets_no_data_pings(default_waits):
    """BUG-15 silence variant: A is silent for 16 s before its first chunk (past the 15 s
    default ping of sse-starlette; scaled down from the case's 20 s). This gateway sends no
    keep-alive pings (documented here: pings are off); if any keep-alive appeared it would
    have to be a ``:`` comment block, never a ``data:`` line. The raw capture and the SDK
    (which would ``json.loads`` a data ping and crash) run concurrently on the same stream
    script and both reconstruct A's content. The scenario (``tests/cases/default_waits.py``)
    runs concurrently with BUG-12's production-defaults test, each on its own backend and
    gateway."""
    seen = default_waits.result("bug15")
    expected = stream_payloads(["a", "b", "c"])
    assert strict_lf_events(seen.raw) == expected  # comments tolerated, nothing else added
    assert seen.sdk == "abc"
