"""Issue 13, kind 1: a backend's own answer reaches the client as the backend sent it.

When no other backend takes a request, the last answer a backend gave (a 429, a 5xx) is
relayed: its status, its body byte for byte and its headers (hop-by-hop ones aside),
repeated headers kept, on every model route (chat, completions, embeddings, the Responses
API, a pass-through route), streaming or not (an error answer to ``stream: true`` is plain
JSON before any event), with the batcher on and off, and to every member of a merged
request. The gateway's own 429 is only for a request it answered without asking anyone.
The client key's ``x-ratelimit-*`` headers never clobber or repeat a backend's own.

Scripted backends at the socket level, the real gateway under uvicorn, httpx where bytes and
repeated headers matter, the ``openai`` SDK where the client's view matters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, ScriptedBackend, completion_obj, wait_for
from tests.support.servers import GatewayThread, gateway_config

Headers = list[tuple[str, str]]

# What A sends with its 429 (the example, plus repeated and hop-by-hop headers).
# The body is written by hand (indent, key order, trailing newline): relayed, it must be
# these bytes, not a re-serialisation.
RATE_LIMIT_BODY = (
    b'{\n "error": {\n  "message": "Rate limit reached for requests (backend a)",\n'
    b'  "type": "rate_limit_error",\n  "param": null,\n  "code": "rate_limit_exceeded"\n'
    b" }\n}\n"
)
RATE_LIMIT_HEADERS: Headers = [
    ("retry-after", "2"),
    ("retry-after-ms", "2000"),
    ("x-ratelimit-limit-requests", "500"),
    ("x-ratelimit-remaining-requests", "0"),
    ("x-ratelimit-reset-requests", "2s"),
    ("set-cookie", "route=a; Path=/"),
    ("set-cookie", "region=eu; Path=/"),
    ("x-foo", "one"),
    ("x-foo", "two"),
    ("connection", "keep-alive"),
    ("connection", "x-hop"),  # a second Connection line: its names are hop-by-hop too
    ("x-hop", "for the gateway only"),  # hence not forwarded
]
HOP_BY_HOP = {"connection", "keep-alive", "x-hop"}


def vllm_error(message: str, type_: str, code: int) -> bytes:
    """vLLM's ``ErrorResponse`` bytes."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()


# status -> (body, content type, headers): what a backend answers
ANSWERS: dict[str, tuple[int, bytes, str, Headers]] = {
    "429": (429, RATE_LIMIT_BODY, "application/json", RATE_LIMIT_HEADERS),
    "500": (
        500,
        vllm_error("EngineCore encountered an issue.", "InternalServerError", 500),
        "application/json",
        [("x-foo", "one"), ("x-foo", "two"), ("x-ratelimit-remaining-requests", "7")],
    ),
    "502": (  # an nginx in front of vLLM: not even JSON
        502,
        b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\r\n",
        "text/html",
        [("set-cookie", "lb=1"), ("set-cookie", "lb2=2"), ("x-foo", "one"), ("x-foo", "two"),
         ("connection", "keep-alive"), ("connection", "x-hop"), ("x-hop", "lb only")],
    ),
    "503_retry_after": (
        503,
        vllm_error("Engine is overloaded.", "ServiceUnavailableError", 503),
        "application/json",
        # (an API gateway in front of vLLM adds its own limits to every answer)
        [("retry-after", "1"), ("x-foo", "one"), ("x-foo", "two"),
         ("x-ratelimit-limit-tokens", "100000")],
    ),
    "503": (
        503,
        vllm_error("Engine is sleeping.", "ServiceUnavailableError", 503),
        "application/json",
        [("x-foo", "one"), ("x-foo", "two"), ("x-ratelimit-remaining-tokens", "0")],
    ),
}

# route id -> (path, body): every kind of model route
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "chat_stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    ),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    "completions_stream": ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}),
    "embeddings": ("/v1/embeddings", {"input": "hi"}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "responses_stream": ("/v1/responses", {"input": "hi", "stream": True}),
    "passthrough": ("/tokenize", {"prompt": "hi"}),
}

# the client key's limits (no client keys configured: per client address), so the gateway
# has x-ratelimit-* headers of its own to add
ADMISSION = {"default_rpm": 6000, "default_tpm": 10_000_000}
BATCHER = {"enabled": True}


async def send_answer(
    conn: Conn, status: int, body: bytes, content_type: str, headers: Headers
) -> None:
    """Write one HTTP answer with exactly these headers, repeated ones as separate lines."""
    lines = [("content-type", content_type), ("content-length", str(len(body))), *headers]
    head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in lines) + "\r\n"
    await conn.write(head.encode("latin-1") + body)


def answering(answer: tuple[int, bytes, str, Headers]) -> Callable[[Received, Conn], Any]:
    """A data-plane script giving every request ``answer``."""
    status, body, ctype, headers = answer

    async def script(req: Received, conn: Conn) -> None:
        await send_answer(conn, status, body, ctype, headers)

    return script


def ok(name: str) -> Callable[[Received, Conn], Any]:
    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(200, completion_obj(name))

    return script


def assert_relayed(r: httpx.Response, answer: tuple[int, bytes, str, Headers]) -> None:
    """``r`` is ``answer`` as the backend sent it: status, body bytes, content type, every
    end-to-end header with all its values in order (hop-by-hop ones dropped), one
    ``x-request-id`` (the gateway's)."""
    status, body, ctype, headers = answer
    assert r.status_code == status, (r.status_code, r.text)
    assert r.content == body
    assert r.headers.get_list("content-type") == [ctype]
    sent: dict[str, list[str]] = {}
    for k, v in headers:
        sent.setdefault(k, []).append(v)
    for name, values in sent.items():
        if name in HOP_BY_HOP:
            continue
        assert r.headers.get_list(name) == values, (name, r.headers.get_list(name), values)
    for name in ("x-hop", "keep-alive"):
        assert name not in r.headers, name
    assert len(r.headers.get_list("x-request-id")) == 1
    assert len(r.headers.get_list("content-length")) == 1


def assert_key_limits_fill_in(r: httpx.Response, answer: tuple[int, bytes, str, Headers]) -> None:
    """The gateway's key limits appear once each, only for the families (``-requests``,
    ``-tokens``) the backend sent none of."""
    sent = {k for k, _ in answer[3] if k.startswith("x-ratelimit-")}
    for family, limit in (("requests", ADMISSION["default_rpm"]),
                          ("tokens", ADMISSION["default_tpm"])):
        names = [f"x-ratelimit-{part}-{family}" for part in ("limit", "remaining", "reset")]
        if any(n in sent for n in names):
            for n in names:
                if n not in sent:
                    assert n not in r.headers, (n, "a family the backend sent is its own")
        else:
            assert r.headers.get_list(names[0]) == [str(limit)]
            assert len(r.headers.get_list(names[1])) == 1
            assert len(r.headers.get_list(names[2])) == 1


def nothing_held(gw: GatewayThread) -> bool:
    """Every request's holds are given back: backend slots, admission tickets, batcher
    reservations, merge-window places and queue (read from the test thread: polled)."""
    g = gw.gateway
    if any(b.in_flight or b.pooled_extra or b.active or b.awaiting for b in g.fleet):
        return False
    if g.gate.scheduler.in_flight:
        return False
    b = g.batching
    return b is None or (not b.pending and not b.merge_flight and b.core.queued == 0)


@pytest.fixture
def fleet() -> Iterator[Callable[..., GatewayThread]]:
    """Factory ``fleet([(id, backend, extra config)], **sections)``: a started gateway in
    front of these backends, each routable (``extra``: e.g. ``role: standby``)."""
    made: list[GatewayThread] = []

    def make(bk: list[tuple[str, ScriptedBackend, dict[str, Any]]],
             **sections: Any) -> GatewayThread:
        cfg = gateway_config([{"id": i, "url": b.url, **x} for i, b, x in bk], **sections)
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(routable=len(bk))
        return gw

    yield make
    for gw in made:
        gw.stop()


def post(gw: GatewayThread, route: str) -> httpx.Response:
    path, body = ROUTES[route]
    return httpx.post(gw.url + path, json={"model": "m1", **body}, timeout=15)


# ---- one backend, every route --------------------------------------------------------------

@pytest.mark.parametrize("batcher", [False, True], ids=["batcher_off", "batcher_on"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_backend_answer_reaches_client_as_sent(backends, gateway, route, batcher):
    """The issue's case: backend A alone answers 429 ``Retry-After: 2``,
    ``retry-after-ms: 2000``, ``x-ratelimit-remaining-requests: 0``, an OpenAI error body,
    two ``set-cookie`` and two ``x-foo``. The client gets exactly that (a ``stream: true``
    request too, as plain JSON), with the key's ``x-ratelimit-*-tokens`` added (A sent none)
    and A's own ``-requests`` ones untouched and not repeated. A was asked once."""
    answer = ANSWERS["429"]
    a = backends(answering(answer))
    extra: dict[str, Any] = {"admission": ADMISSION}
    if batcher:
        extra["batcher"] = BATCHER
    gw = gateway({"a": a}, **extra)
    r = post(gw, route)
    assert_relayed(r, answer)
    assert_key_limits_fill_in(r, answer)
    assert len(a.data_requests) == 1
    assert wait_for(lambda: nothing_held(gw)), "a hold leaked"


@pytest.mark.parametrize("route", ["chat", "chat_stream", "embeddings", "responses_stream"])
@pytest.mark.parametrize("status", [s for s in ANSWERS if s != "429"])
def test_backend_answer_reaches_client_as_sent_for_each_5xx(backends, gateway, status, route):
    """A 500, a 502 (an HTML page from a proxy in front of vLLM), a 503 with and without
    ``Retry-After``: each reaches the client as A sent it, repeated headers kept, the key's
    limits filling in only the ``x-ratelimit-*`` families A did not send."""
    answer = ANSWERS[status]
    a = backends(answering(answer))
    gw = gateway({"a": a}, admission=ADMISSION)
    r = post(gw, route)
    assert_relayed(r, answer)
    assert_key_limits_fill_in(r, answer)


# ---- the client's view ------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_backend_answer_reaches_openai_sdk_as_sent(backends, gateway, stream):
    """openai-python (``max_retries=0``) sees A's 429 as A sent it: ``RateLimitError`` with
    A's error object, ``retry-after: 2``, ``retry-after-ms: 2000`` and
    ``x-ratelimit-remaining-requests: 0``; a streaming call raises it before any event.
    The next request, while A cools, is the gateway's own 429 (A is not asked again): that
    one says so, with the gateway's own code and its wait."""
    a = backends(answering(ANSWERS["429"]))
    gw = gateway({"a": a}, admission=ADMISSION)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    body: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**body, stream=stream)
    e = info.value
    assert e.status_code == 429
    assert e.body == json.loads(RATE_LIMIT_BODY)["error"]
    assert e.type == "rate_limit_error"
    h = e.response.headers
    assert (h["retry-after"], h["retry-after-ms"]) == ("2", "2000")
    assert h.get_list("x-ratelimit-remaining-requests") == ["0"]
    assert h.get_list("x-foo") == ["one", "two"]
    assert len(a.data_requests) == 1

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(**body, stream=stream)
    own = info.value
    assert isinstance(own.body, dict) and own.body["code"] == "rate_limit_exceeded"
    assert "backend a" not in own.message
    assert int(own.response.headers["retry-after"]) in (1, 2)
    assert len(a.data_requests) == 1, "the gateway's own 429 asks no backend"


# ---- several backends -------------------------------------------------------------------

async def _refuse(req: Received, conn: Conn) -> None:
    conn.reset()  # a backend whose data path is gone (connection reset)


@pytest.mark.parametrize("b_does", ["200", "503", "reset"])
def test_backend_answer_last_one_is_relayed(backends, fleet, b_does):
    """A (primary, tried first) answers 429, then B (standby) answers: B's 200 reaches the
    client (fail-over keeps working); B's 503 is the last answer, relayed as B sent it; a
    B that resets the connection gave no answer, so A's 429 is the last one, relayed."""
    a = backends(answering(ANSWERS["429"]))
    b_answer = ANSWERS["503"]
    b_script = {"200": ok("B"), "503": answering(b_answer), "reset": _refuse}[b_does]
    b = backends(b_script)
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})], admission=ADMISSION,
               retry={"budget_min_per_s": 100})
    r = post(gw, "chat")
    assert len(a.data_requests) == 1 and len(b.data_requests) == 1
    if b_does == "200":
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "B"
    elif b_does == "503":
        assert_relayed(r, b_answer)
        assert_key_limits_fill_in(r, b_answer)
    else:
        assert_relayed(r, ANSWERS["429"])


def test_backend_answer_not_relayed_for_the_gateways_own_key(backends, fleet):
    """A 401 to the gateway's own backend key (B's probes found the key refused:
    ``config_error``) is not an answer for the client: relayed, it would tell the client its
    own key is wrong. So A's 429 (A primary, tried first) stays the last answer and is
    relayed; while A cools, B alone gives the gateway's 502 ``backend_auth_failed``, never
    B's 401."""
    refused = [False]
    unauthorized = vllm_error("Unauthorized", "AuthenticationError", 401)

    async def b_control(req: Received, conn: Conn) -> None:
        if refused[0] and req.path == "/v1/models":
            await send_answer(conn, 401, unauthorized, "application/json", [])
        else:
            await b._default_control(req, conn)

    async def b_data(req: Received, conn: Conn) -> None:
        await send_answer(conn, 401, unauthorized, "application/json", [])

    a = backends(answering(ANSWERS["429"]))
    b = backends(b_data, control=b_control)
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})],
               retry={"budget_min_per_s": 100})
    refused[0] = True  # the key is revoked after warm-up: the models refresh sees it
    bk = gw.gateway.fleet.get("b")
    assert wait_for(lambda: bk.config_error is not None, 10), "B's key refusal not seen"
    r = post(gw, "chat")
    assert len(a.data_requests) == 1 and len(b.data_requests) == 1
    assert_relayed(r, ANSWERS["429"])

    r = post(gw, "chat")  # A cools: only B is asked
    assert len(a.data_requests) == 1 and len(b.data_requests) == 2
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "backend_auth_failed"


# ---- merged requests (batcher) ----------------------------------------------------------

MEMBERS = 4
MERGING = {
    "enabled": True,
    "predictive": False,
    "normal": {"max_batch_size": MEMBERS, "max_wait_ms": 1500},
}
MERGE_BODIES = {
    "embeddings": ("/v1/embeddings", lambda i: {"input": f"text {i}"}),
    "completions": ("/v1/completions", lambda i: {"prompt": f"text {i}", "max_tokens": 4}),
}


@pytest.mark.parametrize("status", ["429", "503_retry_after", "500"])
@pytest.mark.parametrize("endpoint", list(MERGE_BODIES))
def test_backend_answer_reaches_each_merged_member_as_sent(backends, gateway, endpoint, status):
    """Concurrent non-stream requests merged into one upstream request: A's answer to it
    (a 429, a 503 with ``Retry-After``: A cools, no other backend; a 500: each member is
    sent again alone and gets A's 500) reaches every member as A sent it."""
    answer = ANSWERS[status]
    a = backends(answering(answer))
    gw = gateway({"a": a}, batcher=MERGING, admission=ADMISSION)
    path, make = MERGE_BODIES[endpoint]

    def call(i: int) -> httpx.Response:
        return httpx.post(gw.url + path, json={"model": "m1", **make(i)}, timeout=15)

    with ThreadPoolExecutor(MEMBERS) as pool:
        got = list(pool.map(call, range(MEMBERS)))
    first = a.data_requests[0].json()
    merged_field = "input" if endpoint == "embeddings" else "prompt"
    assert isinstance(first[merged_field], list) and len(first[merged_field]) == MEMBERS
    for r in got:
        assert_relayed(r, answer)
        assert_key_limits_fill_in(r, answer)
    expected = 1 if status != "500" else 1 + MEMBERS  # cooling: nobody asked again
    assert len(a.data_requests) == expected
    assert wait_for(lambda: nothing_held(gw)), "a hold leaked"


# ---- good answers keep their headers too ------------------------------------------------

OK_HEADERS: Headers = [
    ("set-cookie", "route=a; Path=/"),
    ("set-cookie", "region=eu; Path=/"),
    ("x-foo", "one"),
    ("x-foo", "two"),
    ("x-ratelimit-remaining-requests", "41"),  # an API gateway's limits in front of vLLM
]


async def good_answers(req: Received, conn: Conn) -> None:
    """200s with :data:`OK_HEADERS`: a chat stream, an embeddings list (one vector per
    input, so merged requests split), a chat completion."""
    body = req.json()
    if body.get("stream"):
        head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" \
               "transfer-encoding: chunked\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in OK_HEADERS) + "\r\n"
        await conn.write(head.encode())
        await conn.event({"id": "c", "object": "chat.completion.chunk", "created": 1,
                          "model": "m1", "choices": [{"index": 0, "delta": {"content": "ok"},
                                                      "finish_reason": "stop"}]})
        await conn.done()
        return
    if req.path == "/v1/embeddings":
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        out: dict[str, Any] = {
            "object": "list", "model": "m1",
            "data": [{"object": "embedding", "index": i, "embedding": [0.5]}
                     for i in range(len(inputs))],
            "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)},
        }
    else:
        out = completion_obj("ok")
    await send_answer(conn, 200, json.dumps(out).encode(), "application/json", OK_HEADERS)


@pytest.mark.parametrize("kind", ["plain", "stream", "merged"])
def test_backend_answer_reaches_client_as_sent_when_good(backends, gateway, kind):
    """A 200 (a chat completion, a chat stream, each member's share of a merged embeddings
    request) keeps the backend's repeated headers, and its own
    ``x-ratelimit-remaining-requests`` once: the key's ``-requests`` trio is not added over
    it, its ``-tokens`` trio is."""
    a = backends(good_answers)
    extra: dict[str, Any] = {"batcher": MERGING} if kind == "merged" else {}
    gw = gateway({"a": a}, admission=ADMISSION, **extra)
    answer = (200, b"", "", OK_HEADERS)
    if kind == "merged":
        def call(i: int) -> httpx.Response:
            return httpx.post(gw.url + "/v1/embeddings",
                              json={"model": "m1", "input": f"text {i}"}, timeout=15)

        with ThreadPoolExecutor(MEMBERS) as pool:
            got = list(pool.map(call, range(MEMBERS)))
        assert len(a.data_requests) == 1, "merged into one upstream request"
    else:
        got = [post(gw, "chat_stream" if kind == "stream" else "chat")]
    for r in got:
        assert r.status_code == 200, r.text
        for name in ("set-cookie", "x-foo", "x-ratelimit-remaining-requests"):
            assert r.headers.get_list(name) == [v for k, v in OK_HEADERS if k == name], name
        assert_key_limits_fill_in(r, answer)


# ---- which 429, and when to come back -------------------------------------------------------

def rate_limited_after(retry_after: str | None) -> Callable[[Received, Conn], Any]:
    """A data-plane script answering vLLM-style 429s, with ``Retry-After`` when given."""
    body = vllm_error("Rate limit reached", "RateLimitError", 429)
    headers: Headers = [] if retry_after is None else [("retry-after", retry_after)]
    return answering((429, body, "application/json", headers))


@pytest.mark.parametrize("order", ["sooner_first", "sooner_last"])
def test_backend_answer_429_that_comes_back_sooner_is_relayed(backends, fleet, order):
    """Both backends answer 429, one ``Retry-After: 7``, one ``Retry-After: 3``, whatever
    the order they were asked in: the client gets the ``3`` as that backend sent it (a
    client that waits what it was told then finds a backend ready: case BUG-05)."""
    first, second = ("3", "7") if order == "sooner_first" else ("7", "3")
    a, b = backends(rate_limited_after(first)), backends(rate_limited_after(second))
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})])
    r = post(gw, "chat")
    assert r.status_code == 429
    assert (len(a.data_requests), len(b.data_requests)) == (1, 1)
    assert r.headers.get_list("retry-after") == ["3"]
    assert r.json() == json.loads(vllm_error("Rate limit reached", "RateLimitError", 429))


@pytest.mark.parametrize("route", ["chat", "chat_stream", "embeddings"])
def test_backend_answer_429_without_retry_after_gets_the_gateways(backends, gateway, route):
    """A backend's 429 that says not when to come back is relayed as sent, plus the
    gateway's ``retry-after`` / ``retry-after-ms``: when the backend it now cools is back
    (never a 429 without ``retry-after``: case BUG-05)."""
    a = backends(rate_limited_after(None))
    gw = gateway({"a": a})
    r = post(gw, route)
    assert r.status_code == 429
    assert r.json() == json.loads(vllm_error("Rate limit reached", "RateLimitError", 429))
    assert len(r.headers.get_list("retry-after")) == 1
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert 1 <= int(r.headers["retry-after-ms"]) <= 60_000


# ---- retry-after-ms, and Retry-After values that cannot be honoured ------------------------

def rate_limited_with(headers: Headers) -> Callable[[Received, Conn], Any]:
    """A data-plane script answering vLLM-style 429s with exactly these headers."""
    return answering((429, vllm_error("Rate limit reached", "RateLimitError", 429),
                      "application/json", headers))


def cooling_for_s(gw: GatewayThread, backend_id: str) -> float:
    rows = httpx.get(gw.url + "/admin/backends", timeout=5).json()["backends"]
    return float(next(r for r in rows if r["id"] == backend_id)["cooling_for_s"])


@pytest.mark.parametrize("batcher", [False, True], ids=["batcher_off", "batcher_on"])
@pytest.mark.parametrize("route", ["chat", "chat_stream", "embeddings", "responses",
                                   "passthrough"])
def test_backend_answer_429_with_only_retry_after_ms_is_relayed_as_sent(
    backends, gateway, route, batcher
):
    """A 429 whose only hint is OpenAI's ``retry-after-ms: 250`` (openai-python reads it
    before ``retry-after``) already says when: it reaches the client as sent, one
    ``retry-after-ms`` and no ``retry-after`` of the gateway's (tryout exp20: the client got
    ``['250', '1000']``)."""
    a = backends(rate_limited_with([("retry-after-ms", "250")]))
    sections: dict[str, Any] = {"batcher": BATCHER} if batcher else {}
    gw = gateway({"a": a}, **sections)
    r = post(gw, route)
    assert r.status_code == 429, r.text
    assert r.headers.get_list("retry-after-ms") == ["250"]
    assert r.headers.get_list("retry-after") == []
    assert r.json() == json.loads(vllm_error("Rate limit reached", "RateLimitError", 429))


@pytest.mark.parametrize("order", ["ms_sooner_first", "ms_sooner_last"])
def test_backend_answer_429_that_comes_back_sooner_by_retry_after_ms_is_relayed(
    backends, fleet, order
):
    """Between two 429s, ``retry-after-ms: 3000`` is as much a hint as ``Retry-After: 3``:
    against a ``Retry-After: 7`` the 3 s one is relayed, in either order (case BUG-05)."""
    ms: Headers = [("retry-after-ms", "3000")]
    seven: Headers = [("retry-after", "7")]
    first, second = (ms, seven) if order == "ms_sooner_first" else (seven, ms)
    a, b = backends(rate_limited_with(first)), backends(rate_limited_with(second))
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})])
    r = post(gw, "chat")
    assert r.status_code == 429
    assert (len(a.data_requests), len(b.data_requests)) == (1, 1)
    assert r.headers.get_list("retry-after-ms") == ["3000"]
    assert r.headers.get_list("retry-after") == []


def test_backend_answer_429_retry_after_ms_cools_the_backend(backends, fleet):
    """A backend's ``retry-after-ms: 30000`` cools it for 30 s, not the 1 s default of a
    429 that says nothing: the next requests go to the other backend."""
    a, b = backends(rate_limited_with([("retry-after-ms", "30000")])), backends(ok("b"))
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})])
    assert post(gw, "chat").status_code == 200
    assert len(a.data_requests) == 1
    assert cooling_for_s(gw, "a") > 20


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "0", "Wed, 21 Oct 2015 07:28:00 GMT"],
                         ids=["negative", "nan", "infinite", "zero", "past-date"])
def test_backend_answer_429_with_a_retry_after_that_cannot_be_honoured_still_cools(
    backends, fleet, value
):
    """A 429 whose ``Retry-After`` is not a finite positive wait (``-5``, ``nan``, ``inf``,
    ``0``, a date in the past) is unreadable, like a word: the backend gets the default
    cooling (``retry.default_retry_after_s``, 30 s here) and the next requests go elsewhere
    (tryout exp1: read as 0 s, the backend was not cooled at all). The header reaches the
    client as the backend sent it."""
    a, b = backends(rate_limited_with([("retry-after", value)])), backends(ok("b"))
    gw = fleet([("a", a, {}), ("b", b, {"role": "standby"})],
               retry={"default_retry_after_s": 30})
    for _ in range(3):
        assert post(gw, "chat").status_code == 200
    assert len(a.data_requests) == 1
    assert 20 < cooling_for_s(gw, "a") <= 30  # the default: not 0, not retry.max_cooling_s
    alone = backends(rate_limited_with([("retry-after", value)]))
    r = post(fleet([("c", alone, {})]), "chat")
    assert r.status_code == 429
    assert r.headers.get_list("retry-after") == [value]


# ---- an error answer too large to hold -----------------------------------------------------

HUGE = 20 * 2**20  # bytes of the backend's error body
LIMIT = 2**20  # proxy.max_error_body_bytes' default


@pytest.mark.parametrize("status", [503, 400])
@pytest.mark.parametrize("batcher", [False, True], ids=["batcher_off", "batcher_on"])
@pytest.mark.parametrize("route", ["chat", "chat_stream", "embeddings", "responses",
                                   "passthrough"])
def test_backend_answer_too_large_keeps_its_status_with_its_first_mib(
    backends, gateway, route, batcher, status
):
    """A backend's error answer with a 20 MiB body is not held whole: the gateway reads its
    first MiB (``proxy.max_error_body_bytes``), closes the connection, and relays that
    answer with its status and headers and the first MiB of its body (tryout exp16: a 300 MB
    503 body was buffered whole, ~900 MB of memory). Nothing is left held."""
    body = b'{"error": {"message": "' + b"x" * HUGE + b'"}}'

    async def huge(req: Received, conn: Conn) -> None:
        await send_answer(conn, status, body, "application/json", [("x-foo", "kept")])

    a = backends(huge)
    sections: dict[str, Any] = {"batcher": BATCHER} if batcher else {}
    gw = gateway({"a": a}, **sections)
    r = post(gw, route)
    assert r.status_code == status
    assert r.headers.get_list("x-foo") == ["kept"]
    assert len(r.content) == LIMIT and r.content == body[:LIMIT]
    assert wait_for(lambda: nothing_held(gw))
