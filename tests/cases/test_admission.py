"""Admission control the way a client meets it: per-key limits with OpenAI's
``x-ratelimit-*`` headers, shedding by priority under saturation, the priority queue in
front of the in-flight bound, degraded mode. Scripted backends, the real gateway over HTTP,
the ``openai`` SDK as the client."""

from __future__ import annotations

import math
import threading
import time

import httpx
import openai
import pytest

from tests.support.scripted import (
    Conn,
    Received,
    completion_obj,
    default_script,
    models_obj,
    wait_for,
)

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
KEY = "sk-client-1"


def slow(seconds: float):
    async def script(req: Received, conn: Conn) -> None:
        if await conn.sleep(seconds):
            await conn.send_json(200, completion_obj("ok"))

    return script


def loaded(load: dict[str, float]):
    """Control plane of a vLLM running 4 requests with ``load['waiting']`` queued, finishing
    ``load['rate']`` requests per second (``vllm:request_success_total`` grows with time):
    the gateway learns concurrency 4 and a service rate of ``rate`` requests/s from it."""
    t0 = time.monotonic()

    async def control(req: Received, conn: Conn) -> None:
        if req.path == "/metrics":
            finished = load.get("rate", 2.0) * (time.monotonic() - t0)
            text = (
                f'vllm:num_requests_running{{engine="0"}} 4.0\n'
                f'vllm:num_requests_waiting{{engine="0"}} {load["waiting"]}\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} 0.1\n'
                f'vllm:request_success_total{{engine="0",finished_reason="length"}} '
                f"{finished}\n"
            )
            await conn.send_response(200, text.encode(), content_type="text/plain")
        elif req.path == "/v1/models":
            await conn.send_json(200, models_obj("m1"))
        else:
            await default_script(req, conn)

    return control


def rejections(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "gateway_admission_rejections_total":
                out[(s.labels["layer"], s.labels["priority"])] = s.value
    return out


def assert_honest_429(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert 1000 <= int(r.headers["retry-after-ms"]) <= 60_000
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "rate_limit_exceeded"


# ---- entry layer ---------------------------------------------------------------------------

def test_key_requests_per_minute_with_openai_ratelimit_headers(backends, gateway):
    """A key limited to 3 requests/min: the first 3 succeed and carry
    ``x-ratelimit-limit-requests: 3`` with the remaining count going 2, 1, 0; the 4th is a
    429 with ``retry-after`` about 20 s (one request refills every 20 s), the same
    headers, and the SDK raises ``RateLimitError``. Another key is not affected."""
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "rpm": 3},
                                                 {"name": "two", "key": "sk-two", "rpm": 3}]})
    url = gw.url + "/v1/chat/completions"
    hdr = {"authorization": f"Bearer {KEY}"}
    remaining = []
    sent, answered = [], []
    for _ in range(3):
        sent.append(time.monotonic())
        r = httpx.post(url, json=BODY, headers=hdr, timeout=10)
        answered.append(time.monotonic())
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(r.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    fourth_sent = time.monotonic()
    r = httpx.post(url, json=BODY, headers=hdr, timeout=10)
    fourth_answered = time.monotonic()
    assert_honest_429(r)
    # The bucket (full at the first request) refills one request per 20 s, so the wait is
    # 20 s minus the time between the gateway admitting request 1 and refusing request 4,
    # which lies between these client-side bounds (seconds on a slow machine, ms otherwise).
    longest, shortest = fourth_answered - sent[0], fourth_sent - answered[0]
    wait_ms = int(r.headers["retry-after-ms"])
    assert (20 - longest) * 1000 <= wait_ms <= (20 - shortest) * 1000 + 1, (wait_ms, longest)
    retry_after = int(r.headers["retry-after"])
    assert math.ceil(20 - longest) <= retry_after <= math.ceil(20 - shortest), retry_after
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**BODY)
    other = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-two", max_retries=0)
    assert other.chat.completions.create(**BODY).choices[0].message.content == "ok"
    assert len(a.data_requests) == 4, "rejected requests never reached the backend"
    assert rejections(gw.url)[("entry", "normal")] == 2


async def uses_its_budget(req: Received, conn: Conn) -> None:
    """Answers reporting ``max_tokens`` completion tokens used (the key is charged the
    reported usage once the answer is known)."""
    await conn.send_json(200, completion_obj("ok", completion_tokens=req.json()["max_tokens"]))


def test_key_tokens_per_minute(backends, gateway):
    """A key limited to 600 tokens/min, requests estimated at their prompt + max_tokens and
    then charged the usage they report: two requests that use their 250 tokens pass, the
    third is refused with the ``-tokens`` headers; a request larger than the whole
    per-minute budget is refused with a clear message."""
    a = backends(uses_its_budget)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 600}]})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(**{**BODY, "max_tokens": 250})
        assert raw.headers["x-ratelimit-limit-tokens"] == "600"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**{**BODY, "max_tokens": 250})
    h = info.value.response.headers
    assert int(h["x-ratelimit-remaining-tokens"]) < 300
    assert "x-ratelimit-limit-requests" not in h
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**{**BODY, "max_tokens": 5000})
    assert "exceed" in info.value.message


# ---- resource layer -----------------------------------------------------------------------

def test_saturation_sheds_low_first_high_last(backends, gateway):
    """The only backend runs 4 requests and finishes 2 a second (learned from its
    ``/metrics``). With 5 queued a new request would wait (5 + 1) / 2 = 3 s: over the 2 s
    TTFT SLO, so low priority is shed (1x), normal and high pass; at 9 queued (5 s, over
    2x) normal is shed too; at 19 (10 s, over 4x) everything is shed. Retry-After is the
    excess wait over the class's bound. Priority comes from ``x-priority`` or the client
    key's own priority."""
    load = {"waiting": 5.0, "rate": 2.0}
    a = backends(control=loaded(load))
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "batch", "key": "sk-batch",
                                                  "priority": "low", "max_priority": "high"},
                                                 {"name": "web", "key": KEY,
                                                  "max_priority": "high"}]})
    url = gw.url + "/v1/chat/completions"

    def status(prio: str | None, key: str = KEY) -> int:
        headers = {"authorization": f"Bearer {key}"}
        if prio:
            headers["x-priority"] = prio
        r = httpx.post(url, json=BODY, headers=headers, timeout=10)
        if r.status_code == 429:
            assert_honest_429(r)
            assert "wait about" in r.json()["error"]["message"]
        return r.status_code

    b = gw.gateway.fleet.get("a")

    def settle(waiting: float) -> None:
        load["waiting"] = waiting
        assert wait_for(
            lambda: b.load is not None and b.load.waiting == waiting
            and b.service.service_rate is not None
            and abs(b.service.service_rate - 2.0) < 0.3, 10
        ), (b.load, b.service.service_rate)

    settle(5.0)
    assert [status(p) for p in ("high", "normal", "low")] == [200, 200, 429]
    assert status(None, "sk-batch") == 429, "the key's own priority is low"
    assert status("high", "sk-batch") == 200, "the header overrides the key's priority " \
        "up to its max_priority"
    settle(9.0)
    assert [status(p) for p in ("high", "normal", "low")] == [200, 429, 429]
    settle(19.0)
    r = httpx.post(url, json=BODY, timeout=10,
                   headers={"x-priority": "high", "authorization": f"Bearer {KEY}"})
    assert_honest_429(r)
    # 10 s predicted against the 8 s bound of high priority: retry in about 2 s
    assert 1000 <= int(r.headers["retry-after-ms"]) <= 4000, r.headers["retry-after-ms"]
    assert "high-priority" in r.json()["error"]["message"]
    assert [status(p) for p in ("high", "normal", "low")] == [429, 429, 429]
    settle(0.0)
    assert [status(p) for p in ("high", "normal", "low")] == [200, 200, 200]
    rej = rejections(gw.url)
    assert rej[("resource", "low")] == 4 and rej[("resource", "high")] == 2


def test_a_queue_that_drains_in_time_is_not_shed(backends, gateway):
    """vLLM's own queue is how vLLM works: 16 queued on a backend that finishes 20
    requests a second means a new request starts within 1 s, inside the 2 s SLO, so
    nothing is shed, whatever the priority (the old rule read 16 waiting as saturation
    2.0 and refused everything)."""
    load = {"waiting": 16.0, "rate": 20.0}
    a = backends(control=loaded(load))
    gw = gateway({"a": a})
    b = gw.gateway.fleet.get("a")
    assert wait_for(lambda: b.service.service_rate is not None
                    and b.service.service_rate > 15, 10), b.service.service_rate
    url = gw.url + "/v1/chat/completions"
    for prio in ("low", "normal", "high"):
        r = httpx.post(url, json=BODY, headers={"x-priority": prio}, timeout=10)
        assert r.status_code == 200, r.text
    assert not any(k[0] == "resource" for k in rejections(gw.url))


# ---- scheduler layer ----------------------------------------------------------------------

def _post_async(url: str, prio: str, out: dict[str, httpx.Response]) -> threading.Thread:
    def run() -> None:
        out[prio] = httpx.post(url, json={**BODY, "messages": [{"role": "user",
                                                                "content": prio}]},
                               headers={"x-priority": prio}, timeout=30)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_queue_serves_higher_priority_first(backends, gateway):
    """One slot in flight (``admission.max_in_flight: 1``). While a first request holds
    the slot (2 s), low, normal and high requests queue in
    that order; the backend then receives them high, normal, low. Nothing is rejected."""
    async def script(req: Received, conn: Conn) -> None:
        first = b'"first"' in req.body  # holds the slot while the others queue up
        if await conn.sleep(2.0 if first else 0.2):
            await conn.send_json(200, completion_obj("ok"))

    a = backends(script)
    gw = gateway({"a": a}, admission={"max_in_flight": 1},
                 auth={"anonymous_max_priority": "high"})
    url = gw.url + "/v1/chat/completions"
    out: dict[str, httpx.Response] = {}
    threads = [_post_async(url, "first", out)]
    assert wait_for(lambda: len(a.data_requests) == 1, 5)
    for prio in ("low", "normal", "high"):
        threads.append(_post_async(url, prio, out))
        assert wait_for(lambda: gw.gateway.gate.scheduler.queued == len(threads) - 1, 5)
    for t in threads:
        t.join(30)
    assert all(r.status_code == 200 for r in out.values())
    order = [r.json()["messages"][0]["content"] for r in a.data_requests]
    assert order == ["first", "high", "normal", "low"]


def test_full_queue_sheds_low_and_times_out_with_retry_after(backends, gateway):
    """One slot, a queue of 2 (low may fill half of it), a 2.5 s queue-wait bound, a
    backend that holds the first request until the test lets it go (after the queued
    request's timeout): a second low request is refused at once (its share is full); a
    queued request that waits 2.5 s gets a 429 with Retry-After; the request in flight is
    a 200."""
    release = threading.Event()

    async def held(req: Received, conn: Conn) -> None:
        deadline = time.monotonic() + 20  # (never hangs the test)
        while not release.is_set() and time.monotonic() < deadline:
            if not await conn.sleep(0.02):
                return
        await conn.send_json(200, completion_obj("ok"))

    a = backends(held)
    gw = gateway({"a": a}, admission={"max_in_flight": 1, "max_queued": 2,
                                      "max_queue_wait_s": 2.5})
    url = gw.url + "/v1/chat/completions"
    out: dict[str, httpx.Response] = {}
    first = _post_async(url, "normal", out)
    try:
        assert wait_for(lambda: len(a.data_requests) == 1, 5)
        queued_at = time.monotonic()
        queued = _post_async(url, "low", out)
        assert wait_for(lambda: gw.gateway.gate.scheduler.queued == 1, 5)
        r = httpx.post(url, json=BODY, headers={"x-priority": "low"}, timeout=10)
        assert_honest_429(r)
        assert "queue is full" in r.json()["error"]["message"]
        queued.join(10)
        assert time.monotonic() - queued_at >= 2.5  # it waited its whole bound
        assert_honest_429(out["low"])
        assert "max_queue_wait_s" in out["low"].json()["error"]["message"]
    finally:
        release.set()
    first.join(10)
    assert out["normal"].status_code == 200
    assert len(a.data_requests) == 1


# ---- degraded mode ------------------------------------------------------------------------

def test_degraded_mode_caps_max_tokens_under_sustained_overload_then_lifts(backends, gateway):
    """Degraded mode on, entering after 0.6 s of overload (requests queued), lifting one
    level per 0.6 s of calm: with one slot and a slow backend, a queue builds for over a
    second; the gateway reports ``gateway_degraded_mode`` >= 1, forwards later
    requests with ``max_tokens`` capped at 64, refuses long low-priority prompts; once the
    queue is gone the level steps back to 0 and requests pass unchanged."""
    a = backends(slow(0.5))
    gw = gateway(
        {"a": a},
        admission={"max_in_flight": 1},
        degraded={"enabled": True, "enter_after_s": 0.6, "step_s": 0.6, "tick_s": 0.1,
                  "max_tokens_cap": 64, "low_priority_max_prompt_tokens": 50},
    )
    url = gw.url + "/v1/chat/completions"
    gate = gw.gateway.gate
    out: dict[str, httpx.Response] = {}
    threads = [_post_async(url, p, out) for p in ("n1", "n2", "n3", "n4")]
    assert wait_for(lambda: gate.degraded.level >= 1, 5)
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    assert "gateway_degraded_mode 1.0" in metrics or "gateway_degraded_mode 2.0" in metrics
    long_low = {**BODY, "messages": [{"role": "user", "content": "x" * 1000}]}
    r = httpx.post(url, json=long_low, headers={"x-priority": "low"}, timeout=10)
    assert_honest_429(r)
    assert "degraded" in r.json()["error"]["message"]
    capped = _post_async(url, "high", {})
    for t in [*threads, capped]:
        t.join(30)
    sent = {rq.json()["messages"][0]["content"]: rq.json() for rq in a.data_requests}
    assert sent["high"]["max_tokens"] <= 64
    assert sent["high"]["messages"] == [{"role": "user", "content": "high"}]
    assert wait_for(lambda: gate.degraded.level == 0, 10)
    r = httpx.post(url, json={**BODY, "max_tokens": 200}, timeout=10)
    assert r.status_code == 200
    assert a.data_requests[-1].json()["max_tokens"] == 200


def test_request_larger_than_the_token_limit_is_not_retried_by_the_sdk(backends, gateway):
    """A request whose estimate exceeds the key's whole tokens-per-minute budget can never
    pass: 429 with ``type: tokens``, the limit in the message (no "inf"), and
    ``x-should-retry: false`` so the SDK (``max_retries=2``) raises at once instead of
    sleeping twice; a request the key could pass later is still retryable. Refused
    requests do not use up the key's quota."""
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 300}]})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**{**BODY, "max_tokens": 1000})
    assert time.monotonic() - t0 < 2.0, "no retry of a request that can never fit"
    r = info.value.response
    assert r.headers["x-should-retry"] == "false" and "retry-after" in r.headers
    err = r.json()["error"]
    assert err["type"] == "tokens" and "300" in err["message"] and "inf" not in err["message"]
    assert len(a.data_requests) == 0
    ok = client.chat.completions.with_raw_response.create(**{**BODY, "max_tokens": 100})
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) > 150  # the refusal cost nothing


@pytest.mark.parametrize(
    "budget",
    [{"max_tokens": "1000"}, {"max_tokens": 1, "max_completion_tokens": 1000},
     {"max_tokens": -5000, "max_completion_tokens": 1000}, {"max_tokens": 100, "n": 10},
     {"max_tokens": 100, "n": "10"}, {"max_tokens": None, "n": 8}],
    ids=["string", "max_completion_tokens", "negative-plus-other", "n-choices", "n-string",
         "n-without-max-tokens"],
)
def test_token_limit_counts_every_way_to_ask_for_tokens(backends, gateway, budget):
    """Each body asks vLLM for 1000 completion tokens or more (``n`` 8 without a budget:
    8 x the 256 default), over the key's 300 per minute: each is refused before reaching
    the backend, and a negative ``max_tokens`` never raises the key's remaining tokens
    above its limit."""
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 300}]})
    h = {"authorization": f"Bearer {KEY}"}
    url = gw.url + "/v1/chat/completions"
    r = httpx.post(url, json={**BODY, **budget}, headers=h, timeout=10)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens", r.text
    assert not a.data_requests
    r = httpx.post(url, json={**BODY, "max_tokens": -5000}, headers=h, timeout=10)
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 300


def test_token_limit_counts_every_prompt_of_a_completions_request(backends, gateway):
    """8 prompts x ``max_tokens`` 100 is 800 completion tokens: over 300 per minute."""
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 300}]})
    r = httpx.post(gw.url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "m1", "prompt": ["p"] * 8, "max_tokens": 100}, timeout=10)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens", r.text
    assert not a.data_requests


def test_a_refused_request_does_not_use_the_keys_quota(backends, gateway):
    """rpm 2 and one slot with no queue: while a request holds the slot, two more are
    refused by the scheduler (429); they are given back to the key's quota, so once the
    slot is free the key can still send."""
    a = backends(slow(1.5))
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "rpm": 2}]},
                 admission={"max_in_flight": 1, "max_queued": 0})
    url = gw.url + "/v1/chat/completions"
    hdr = {"authorization": f"Bearer {KEY}"}
    out: dict[str, httpx.Response] = {}

    def first() -> None:
        out["first"] = httpx.post(url, json=BODY, headers=hdr, timeout=10)

    t = threading.Thread(target=first)
    t.start()
    assert wait_for(lambda: len(a.data_requests) == 1, 5)
    for _ in range(2):
        r = httpx.post(url, json=BODY, headers=hdr, timeout=10)
        assert_honest_429(r)
        assert "queue" in r.json()["error"]["message"]
    t.join(10)
    assert out["first"].status_code == 200
    r = httpx.post(url, json=BODY, headers=hdr, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
