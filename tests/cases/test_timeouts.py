"""Timeouts on the data path: long generations are never cut by a fixed total deadline, a
stuck backend is cut by the idle timeout with an explicit error (case BUG-12).

The case's real durations (a 90 s stream, a 120 s silent non-stream) are kept in spirit two
ways: (1) every gateway timeout is configured small (about 1-4 s) and a stream longer than
all of them must survive; (2) the gateway runs with its production default
timeouts from ``gateway/config.py`` while a ~22 s stream and a ~22 s silent non-stream run
concurrently through the openai SDK (beyond httpx's 5 s default and common 15 s route
defaults, the failure kinds of the report).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.rawclient import RawClient
from tests.support.scripted import Conn, Received, chunk_obj, completion_obj, wait_for

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}

# Scaled gateway timeouts: every one of them below the stream's duration; the idle timeout
# is 5x the stream's gaps and the ttfb timeout 1.5 s above the non-stream's silence, so a
# loaded machine does not trip them.
SMALL = {"connect_timeout_s": 1.0, "ttfb_timeout_s": 4.0, "idle_timeout_s": 2.0,
         "keepalive_timeout_s": 1.0}


def counter_total(counter) -> float:
    """Sum of a labelled Prometheus counter over all its label sets."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def long_script(n_chunks: int, every_s: float, silent_s: float):
    """Streams ``n_chunks`` content chunks ``every_s`` apart then ``[DONE]``; a non-stream
    request is answered after ``silent_s`` of total silence (headers only at the end)."""

    async def script(req: Received, conn: Conn) -> None:
        if not req.json().get("stream"):
            if await conn.sleep(silent_s):
                await conn.send_json(200, completion_obj("the whole answer", completion_tokens=3))
            return
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content=""))
        for i in range(n_chunks):
            if not await conn.sleep(every_s):
                return
            if not await conn.event(chunk_obj(content=f"t{i} ")):
                return
        await conn.event(chunk_obj(finish="stop"))
        await conn.done()

    return script


def sdk_stream(url: str, **kw) -> tuple[list[str], float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    t0 = time.monotonic()
    texts = []
    for ch in client.chat.completions.create(**{**BODY, "stream": True}, **kw):
        if ch.choices and ch.choices[0].delta.content:
            texts.append(ch.choices[0].delta.content)
    return texts, time.monotonic() - t0


def sdk_complete(url: str) -> tuple[str, float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    t0 = time.monotonic()
    r = client.chat.completions.create(**BODY)
    return r.choices[0].message.content or "", time.monotonic() - t0


def test_BUG_12_stream_outlives_every_configured_timeout(backends, gateway):
    """BUG-12 repro 1 and 2, scaled: connect 1 s, ttfb 4 s, idle 2 s, pool keep-alive 1 s
    (health probe timeout 1 s, uvicorn keep-alive 5 s). A stream of 16 chunks 0.4 s apart
    (~6.4 s, longer than every one of those) arrives whole with ``[DONE]`` and no error; a
    non-stream answer after 2.5 s of silence (> idle timeout) is a 200 with the full body,
    because only the documented ``ttfb_timeout_s`` bounds a non-stream's wait."""
    a = backends(long_script(16, 0.4, 2.5))
    gw = gateway({"a": a}, proxy=SMALL)
    with ThreadPoolExecutor(2) as ex:
        f_stream = ex.submit(sdk_stream, gw.url)
        f_plain = ex.submit(sdk_complete, gw.url)
        texts, took = f_stream.result(timeout=30)
        content, took_plain = f_plain.result(timeout=30)
    assert texts == [f"t{i} " for i in range(16)]
    assert took >= 6.0  # it really outlived every configured timeout
    assert content == "the whole answer" and took_plain >= 2.4
    assert counter_total(gw.gateway.metrics.stream_errors) == 0  # no stream ended in error


def test_BUG_12_production_defaults_long_stream_and_silent_non_stream(default_waits):
    """BUG-12 repro 1 and 2 with the gateway's production default proxy timeouts (no
    ``proxy`` section): concurrently, a stream of 17 chunks 1 s apart (~17 s, scaled from the
    case's 90 s) and a non-stream that answers after 17 s of silence (scaled from 120 s),
    both through the openai SDK: both longer than the 5 s / 15 s timeouts the case reports.
    Both must complete: all chunks + ``[DONE]`` with no error, and a 200 with the full body
    (no 504 at 5/15 s). The scenario (``tests/cases/default_waits.py``) runs concurrently
    with BUG-15's silence test, each on its own backend and gateway."""
    seen = default_waits.result("bug12")
    assert seen.ttfb_timeout_s >= 120  # the documented non-stream deadline
    assert seen.texts == [f"t{i} " for i in range(17)]
    assert seen.took >= 16.5
    assert seen.content == "the whole answer" and seen.took_plain >= 16.5
    assert seen.stream_errors == 0


def stuck_after_first_chunk(first_sent: list[float]):
    """Headers and a first chunk, then silent "forever" (wakes if the gateway closes);
    appends to ``first_sent`` the monotonic time just before the last chunk is written (the
    gateway's idle clock cannot start before it)."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content=""))
        first_sent.append(time.monotonic())
        await conn.event(chunk_obj(content="first"))
        await conn.sleep(30)

    return script


def test_BUG_12_stuck_backend_cut_by_idle_timeout(backends, gateway):
    """BUG-12 repro 3, scaled: idle timeout 1 s (the case suggests 30 s). A sends headers and
    a first chunk, then nothing. The client gets the first chunk, then after ~1 s one error
    event in the BUG-09 shape and ``[DONE]``; the gateway closes A's connection at that
    moment; the SDK yields the chunk then raises ``APIError``."""
    first_sent: list[float] = []
    a = backends(stuck_after_first_chunk(first_sent))
    gw = gateway({"a": a}, proxy={"idle_timeout_s": 1.0})
    c = RawClient(gw.url)
    c.send("POST", "/v1/chat/completions", {**BODY, "stream": True})
    c.read_until(b'"first"')
    raw = c.read_until(b"data: [DONE]\n\n", timeout=10)
    error_at = time.monotonic()
    c.close()
    assert b"200 OK" in raw.split(b"\r\n", 1)[0]
    # Measured from A's own write of the chunk (same clock, same process), not from when the
    # client read it: the error cannot come before the idle timeout, however late the client
    # thread runs; the upper bound leaves 2 s for a loaded machine.
    first_at = first_sent[0]
    assert 0.95 <= error_at - first_at <= 3.0, error_at - first_at
    body = raw.split(b"\r\n\r\n", 1)[1]
    errors = [json.loads(line[len(b"data: "):])["error"]
              for line in body.split(b"\n") if line.startswith(b'data: {"error"')]
    assert len(errors) == 1
    err = errors[0]
    assert err["message"] and err["type"] == "server_error" and err["param"] is None
    assert err["code"] == "upstream_idle_timeout"
    assert b'"finish_reason": "stop"' not in body
    req = a.data_requests[0]
    assert wait_for(lambda: req.peer_closed_at is not None, 3)
    assert req.peer_closed_at - first_at <= 3.0  # the gateway closed A, not the client

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    got = []
    with pytest.raises(openai.APIError):
        for ch in client.chat.completions.create(**{**BODY, "stream": True}):
            got.append(ch.choices[0].delta.content)
    assert got == ["", "first"]


@pytest.mark.parametrize("stuck", ["headers_only", "nothing"])
def test_BUG_12_stuck_before_first_byte_is_explicit(backends, gateway, stuck):
    """BUG-12 "Must NOT: 502/504 HTML", before any byte reached the client: a backend that
    sends only stream headers, or nothing at all, is cut at the configured ``ttfb_timeout_s``
    (1 s here, and ``idle_timeout_s`` 1 s once headers are in) with a 504 in OpenAI error
    shape (JSON), and A's connection is closed. Also the non-stream form (silence beyond the
    documented non-stream deadline)."""

    async def script(req: Received, conn: Conn) -> None:
        if stuck == "headers_only":
            await conn.start_stream()
        await conn.sleep(30)

    a = backends(script)
    gw = gateway({"a": a}, proxy={"ttfb_timeout_s": 1.0, "idle_timeout_s": 1.0})
    for body in ({**BODY, "stream": True}, BODY):
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 504, (r.status_code, r.text)
        assert 0.8 <= time.monotonic() - t0 <= 4
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert err["message"] and err["type"] and "code" in err and "param" in err
        req = a.data_requests[-1]
        assert wait_for(lambda req=req: req.peer_closed_at is not None, 3)


def test_BUG_12_flowing_non_stream_body_not_cut(backends, gateway):
    """BUG-12, same kind for a non-stream answer whose bytes keep flowing: A sends the headers
    at once, then its JSON body in 8 pieces 0.4 s apart (~3 s). With ``idle_timeout_s`` = 2 s
    (documented as "max silence between chunks") no silence ever exceeds the limit, so the
    client must get a 200 with the whole body, not a 504 after 2 s (a total deadline on the
    body read is a wall-clock timeout under another name)."""
    answer = json.dumps(completion_obj("slowly sent body")).encode()

    async def trickle(req: Received, conn: Conn) -> None:
        head = ("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                f"content-length: {len(answer)}\r\n\r\n")
        await conn.write(head.encode())
        step = -(-len(answer) // 8)
        for i in range(0, len(answer), step):
            if not await conn.sleep(0.4):
                return
            await conn.write(answer[i:i + step])

    a = backends(trickle)
    gw = gateway({"a": a}, proxy={"idle_timeout_s": 2.0, "ttfb_timeout_s": 2.0})
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=20)
    took = time.monotonic() - t0
    assert r.status_code == 200, (r.status_code, r.text, round(took, 2))
    assert r.content == answer
    assert took >= 3.0  # the body took longer than either timeout
