"""Backend 429s, gateway 429s and the circuit breaker, the way a client meets them
(cases BUG-04, BUG-05, BUG-06 of ../shared/cases/gateway-cases.md): scripted backends, the
real gateway over HTTP, the ``openai`` SDK as the client."""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, completion_obj, error_obj

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def rate_limited(retry_after: str):
    """Data plane: always 429 with ``Retry-After`` (OpenAI's error body)."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(
            429,
            error_obj("Rate limit reached", 429, "RateLimitError"),
            headers={"retry-after": retry_after},
        )

    return script


def named(name: str):
    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(200, completion_obj(name))

    return script


def admin_backend(gw, backend_id: str) -> dict:
    rows = httpx.get(gw.url + "/admin/backends", timeout=5).json()["backends"]
    return next(r for r in rows if r["id"] == backend_id)


# ---- BUG-04 --------------------------------------------------------------------------------

COOL_S = 6
"""A's ``Retry-After`` (s)."""
BURST_S = COOL_S - 1.5
"""How long the burst goes on: most of A's cooldown, so that a cooldown cut short shows,
with 1.5 s to spare for the last request (about 10 ms here) even on a slow machine."""


def test_BUG_04_backend_429_fails_over_and_cools(backends, gateway):
    """BUG-04, Retry-After scaled from 10 s to 6 s: A always answers 429 with
    ``Retry-After: 6``; B answers normally. Sequential requests (one every ~0.1 s) for the
    first 4.5 s, inside A's cooldown, are all 200 from B; A gets exactly one of them (the
    first that reached it) and nothing more until its cooldown ends; at most one attempt
    per backend per request (<= requests + 1 attempts); A's 429 is not a breaker failure
    and A stays warm. One more request after the cooldown may reach A again."""
    a, b = backends(rate_limited(str(COOL_S))), backends(named("B"))
    gw = gateway({"a": a, "b": b})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < BURST_S:
        r = client.chat.completions.create(**BODY)
        assert r.choices[0].message.content == "B"
        sent += 1
        time.sleep(0.1)
    row = admin_backend(gw, "a")
    # (A's cooldown began at its 429, after t0: the burst and the look at A were inside it)
    assert time.monotonic() - t0 < COOL_S, "the burst must fit inside A's cooldown"
    assert sent >= 10, sent
    assert len(a.data_requests) == 1
    assert len(a.data_requests) + len(b.data_requests) <= sent + 1
    assert row["state"] == "warm"
    assert row["breaker"]["state"] == "closed"
    assert row["breaker"]["consecutive_failures"] == 0
    assert row["cooling_for_s"] > 0
    time.sleep(max(0.0, t0 + COOL_S + 0.3 - time.monotonic()))
    r = client.chat.completions.create(**BODY)  # A may be tried again: it 429s, B answers
    assert r.choices[0].message.content == "B"
    assert len(a.data_requests) <= 2


# ---- BUG-05 --------------------------------------------------------------------------------

def test_BUG_05_gateway_429_when_every_backend_cools(backends, gateway):
    """BUG-05: A 429 ``Retry-After: 7``, B 429 ``Retry-After: 3``. At t=0 the gateway tries
    both and, since it asked them, relays a backend's own 429 as that backend sent it
    (issue 13), the one back sooner: B's, ``retry-after: 3`` (the earliest availability,
    integer seconds), OpenAI error shape; at t=1 it answers 429 itself without contacting
    either: the earliest availability, ``retry-after`` in {2, 3} (integer seconds) with
    ``retry-after-ms``, code ``rate_limit_exceeded``; at t=4 B is contacted again."""
    a, b = backends(rate_limited("7")), backends(rate_limited("3"))
    gw = gateway({"a": a, "b": b})
    url = gw.url + "/v1/chat/completions"
    t0 = time.monotonic()
    r = httpx.post(url, json=BODY, timeout=10)
    assert r.status_code == 429
    assert (len(a.data_requests), len(b.data_requests)) == (1, 1)
    assert r.headers["retry-after"] == "3"
    assert "retry-after-ms" not in r.headers, "the backend sent none"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err == error_obj("Rate limit reached", 429, "RateLimitError")["error"]

    time.sleep(max(0.0, t0 + 1.0 - time.monotonic()))
    r = httpx.post(url, json=BODY, timeout=10)
    assert r.status_code == 429
    assert r.headers["retry-after"] in ("2", "3")
    assert 1000 <= float(r.headers["retry-after-ms"]) <= 3000
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert (len(a.data_requests), len(b.data_requests)) == (1, 1), "backends not contacted"

    time.sleep(max(0.0, t0 + 4.0 - time.monotonic()))
    r = httpx.post(url, json=BODY, timeout=10)
    assert r.status_code == 429
    assert len(b.data_requests) == 2, "B's cooldown is over: it is tried again"
    assert len(a.data_requests) == 1, "A still cools until t=7"
    for backend_id in ("a", "b"):
        row = admin_backend(gw, backend_id)
        assert row["state"] == "warm" and row["breaker"]["state"] == "closed"


def test_BUG_05_openai_sdk_waits_the_advertised_seconds(backends, gateway):
    """openai-python with ``max_retries=2`` against a gateway whose only backend keeps
    answering 429 ``Retry-After: 2``: it makes 3 attempts, waiting about the advertised
    2 s between them (so about 4 s in all), then raises ``RateLimitError`` carrying the
    gateway's ``retry-after``."""
    a = backends(rate_limited("2"))
    gw = gateway({"a": a})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**BODY)
    elapsed = time.monotonic() - t0
    assert 3.5 <= elapsed <= 6.5, elapsed
    assert info.value.response.headers["retry-after"] in ("1", "2")
    # Each attempt reached the backend once its cooldown ended, never during it.
    times = [r.at for r in a.data_requests]
    assert 2 <= len(times) <= 3
    assert all(t2 - t1 >= 1.8 for t1, t2 in itertools.pairwise(times))


# ---- BUG-06 --------------------------------------------------------------------------------

TOO_LONG = error_obj(
    "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens.",
    400,
)


def picky(name: str):
    """Answers requests with a marker in the prompt with that 4xx, the rest normally."""

    async def script(req: Received, conn: Conn) -> None:
        text = req.body.decode()
        if "TOO_LONG" in text:
            await conn.send_json(400, TOO_LONG)
        elif "NO_AUTH" in text:
            await conn.send_json(401, error_obj("Unauthorized", 401, "AuthenticationError"))
        elif "NO_MODEL" in text:
            await conn.send_json(404, error_obj("The model `x` does not exist.", 404,
                                                "NotFoundError"))
        elif "BROKEN" in text:
            await conn.send_json(500, error_obj("engine died", 500, "InternalServerError"))
        else:
            await conn.send_json(200, completion_obj(name))

    return script


def with_text(text: str) -> dict:
    return {**BODY, "messages": [{"role": "user", "content": text}]}


def test_BUG_06_4xx_never_open_the_breaker(backends, gateway):
    """BUG-06 with the breaker opening after 5 consecutive failures: 20 ``TOO_LONG``
    requests each get the backend's 400 unchanged from exactly one backend attempt; a batch
    of 401s and a batch of 404s from the backends pass through the same way; both breakers
    stay closed, both backends warm; the 10 normal requests that follow are all 200."""
    a, b = backends(picky("A")), backends(picky("B"))
    gw = gateway({"a": a, "b": b}, breaker={"consecutive_failures": 5})
    url = gw.url + "/v1/chat/completions"
    for _ in range(20):
        r = httpx.post(url, json=with_text("TOO_LONG " * 3), timeout=10)
        assert r.status_code == 400
        assert r.json() == TOO_LONG
    assert len(a.data_requests) + len(b.data_requests) == 20, "no failover on 4xx"
    for marker, status in (("NO_AUTH", 401), ("NO_MODEL", 404)):
        before = len(a.data_requests) + len(b.data_requests)
        for _ in range(6):
            r = httpx.post(url, json=with_text(marker), timeout=10)
            assert r.status_code == status, r.text
            assert r.json()["error"]["code"] == status
        assert len(a.data_requests) + len(b.data_requests) - before == 6
    for backend_id in ("a", "b"):
        row = admin_backend(gw, backend_id)
        assert row["state"] == "warm"
        assert row["breaker"]["state"] == "closed" and row["breaker"]["trips"] == 0
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    got = {client.chat.completions.create(**BODY).choices[0].message.content for _ in range(10)}
    assert got <= {"A", "B"}


def test_BUG_06_control_5xx_do_open_the_breaker(backends, gateway):
    """The control: 6 consecutive 500s from A open A's breaker and traffic shifts to B
    (every client request still a 200: the 500s failed over before any byte was sent)."""
    a = backends(picky("A"))
    b = backends(named("B"))
    gw = gateway({"a": a, "b": b}, breaker={"consecutive_failures": 5, "open_base_s": 30})
    url = gw.url + "/v1/chat/completions"
    for _ in range(12):
        r = httpx.post(url, json=with_text("BROKEN"), timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "B"
    row = admin_backend(gw, "a")
    assert row["breaker"]["state"] == "open"
    assert row["breaker"]["last_trip_reason"] == "consecutive_failures"
    hits = len(a.data_requests)
    assert hits == 5
    for _ in range(5):
        assert httpx.post(url, json=BODY, timeout=10).json()["choices"][0]["message"][
            "content"] == "B"
    assert len(a.data_requests) == hits, "no traffic while open"


def test_backend_retry_after_beyond_a_minute_is_capped_and_still_a_429(backends, gateway):
    """A backend answering 429 ``Retry-After: 3600``: that answer reaches the client as
    sent (the backend's word), but the backend cools for at most ``retry.max_cooling_s``
    (60 s), and while it does the gateway answers 429 "rate-limited" with ``retry-after``
    <= 60, never a 503 claiming the backends are unhealthy."""
    a = backends(rate_limited("3600"))
    gw = gateway({"a": a})
    url = gw.url + "/v1/chat/completions"
    r = httpx.post(url, json=BODY, timeout=10)
    assert r.status_code == 429 and r.headers["retry-after"] == "3600", r.text
    for _ in range(2):
        r = httpx.post(url, json=BODY, timeout=10)
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert "rate-limited" in r.json()["error"]["message"]
    assert len(a.data_requests) == 1
    assert 0 < admin_backend(gw, "a")["cooling_for_s"] <= 60


@pytest.mark.parametrize(
    ("action", "body", "param"),
    [
        ("drain", b'{"deadline_s": 1e999}', "deadline_s"),
        ("drain", b'{"deadline_s": NaN}', "deadline_s"),
        ("drain", b'{"deadline_s": ' + b"9" * 400 + b"}", "deadline_s"),
        ("drain", b'{"deadline_s": -1}', "deadline_s"),
        ("drain", b'{"deadlin_s": 5}', "deadlin_s"),
        ("preempt", b'{"deadline_s": "soon"}', "deadline_s"),
        ("cooldown", b'{"force": "yes"}', "force"),
        ("cooldown", b'{"min_rest_s": Infinity}', "min_rest_s"),
    ],
)
def test_admin_bodies_are_checked_and_nothing_happens_on_a_400(
    backends, gateway, action, body, param
):
    """Bad admin bodies (non-finite or huge numbers, a typo'd field, wrong types) get a 400
    in OpenAI's shape naming the field, and leave the backend as it was (and the admin
    listing working)."""
    a = backends()
    gw = gateway({"a": a})
    r = httpx.post(f"{gw.url}/admin/backends/a/{action}", content=body, timeout=5,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    listing = httpx.get(gw.url + "/admin/backends", timeout=5)
    assert listing.status_code == 200
    assert admin_backend(gw, "a")["state"] == "warm"
