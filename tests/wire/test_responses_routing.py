"""Kind: the Responses API is stateful; route it so (issue 13, item 5).

Each scripted backend keeps a tiny Responses store, as vLLM does (in its process memory):
``POST /v1/responses`` creates a response with an id unique to that backend (stream or
not), a follow-up naming a ``previous_response_id`` it does not hold gets vLLM's 404, and
``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel`` and ``GET .../input_items``
answer only for the ids it holds. Clients are the real ``openai`` SDK.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, ScriptedBackend, error_obj, wait_for


class ResponsesStore:
    """One backend's stored responses, and the script that serves them."""

    _ids = itertools.count()

    def __init__(self, name: str) -> None:
        self.name = name
        self.store: dict[str, dict[str, Any]] = {}
        self.asked: list[tuple[str, str]] = []  # (method, path) of Responses calls

    def response(self, rid: str, status: str = "completed") -> dict[str, Any]:
        return {
            "id": rid, "object": "response", "created_at": 1, "model": "m1", "status": status,
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": f"from {self.name}",
                                     "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "metadata": {"backend": self.name},
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        }

    async def script(self, req: Received, conn: Conn) -> None:
        path, _, query = req.path.partition("?")
        if not path.startswith("/v1/responses"):
            await conn.send_json(404, error_obj("not found", 404, "NotFoundError"))
            return
        self.asked.append((req.method, req.path))
        if path == "/v1/responses" and req.method == "POST":
            await self._create(req, conn)
            return
        rid, _, action = path[len("/v1/responses/"):].partition("/")
        stored = self.store.get(rid)
        if stored is None:  # vLLM's _make_not_found_error
            await conn.send_json(404, {"error": {
                "message": f"Response with id '{rid}' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}})
        elif req.method == "GET" and action == "" and "stream=true" in query:
            await conn.start_stream()
            await conn.chunk(_sse("response.completed", {"type": "response.completed",
                                                         "response": stored}))
            await conn.write(b"0\r\n\r\n")
        elif req.method == "GET" and action == "":
            await conn.send_json(200, stored)
        elif req.method == "DELETE" and action == "":
            del self.store[rid]
            await conn.send_json(200, {"id": rid, "object": "response", "deleted": True})
        elif req.method == "POST" and action == "cancel":
            await conn.send_json(200, {**stored, "status": "cancelled"})
        elif req.method == "GET" and action == "input_items":
            await conn.send_json(200, {"object": "list", "data": [], "first_id": None,
                                       "last_id": None, "has_more": False})
        else:
            await conn.send_json(405, {"detail": "Method Not Allowed"})

    async def _create(self, req: Received, conn: Conn) -> None:
        body = req.json()
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.store:
            await conn.send_json(404, {"error": {
                "message": f"Response with id '{prev}' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}})
            return
        rid = f"resp_{self.name}{next(self._ids):04d}"
        obj = self.response(rid)
        self.store[rid] = obj
        if not body.get("stream"):
            await conn.send_json(200, obj)
            return
        await conn.start_stream()
        await conn.chunk(_sse("response.created", {
            "type": "response.created", "sequence_number": 0,
            "response": {**obj, "status": "in_progress", "output": []}}))
        await conn.chunk(_sse("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": 1, "item_id": f"msg_{rid}",
            "output_index": 0, "content_index": 0, "delta": f"from {self.name}",
            "logprobs": []}))
        await conn.chunk(_sse("response.completed", {
            "type": "response.completed", "sequence_number": 2, "response": obj}))
        await conn.write(b"0\r\n\r\n")


def _sse(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


def stateful(backends, *names: str) -> dict[str, tuple[ScriptedBackend, ResponsesStore]]:
    out = {}
    for n in names:
        store = ResponsesStore(n)
        out[n] = (backends(store.script), store)
    return out


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0, timeout=20)


def create(client: openai.OpenAI, stream: bool, **kw: Any) -> str:
    """A response created through the gateway; its id."""
    if not stream:
        return client.responses.create(model="m1", input="hi", **kw).id
    with client.responses.create(model="m1", input="hi", stream=True, **kw) as events:
        got = list(events)
    assert got[0].type == "response.created" and got[-1].type == "response.completed", got
    return got[-1].response.id


BATCHER = [pytest.param(False, id="batcher-off"), pytest.param(True, id="batcher-on")]


def start(gateway, fleet, batcher: bool, **sections: Any):
    if batcher:
        sections["batcher"] = {"enabled": True}
    return gateway({n: b for n, (b, _) in fleet.items()},
                   routing={"policy": "round_robin"}, **sections)


@pytest.mark.parametrize("batcher", BATCHER)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_responses_follow_up_reaches_the_backend_that_created_it(
        backends, gateway, stream, batcher):
    """10 of 10 follow-ups went to the other backend and got its 404 (round robin
    alternates): each must reach the backend holding its previous response."""
    fleet = stateful(backends, "a", "b")
    gw = start(gateway, fleet, batcher)
    client = sdk(gw)
    for _ in range(10):
        first = create(client, stream)
        follow = create(client, stream, previous_response_id=first)
        assert follow[:6] == first[:6], (first, follow)  # resp_a... / resp_b...
    assert sum(len(s.store) for _, s in fleet.values()) == 20  # no 404 created nothing


@pytest.mark.parametrize("batcher", BATCHER)
def test_responses_by_id_calls_reach_the_backend_that_holds_it(backends, gateway, batcher):
    """GET, its stream, input_items, cancel and DELETE by id go to the owner (before: the
    gateway's own 404, no backend asked)."""
    fleet = stateful(backends, "a", "b")
    gw = start(gateway, fleet, batcher)
    client = sdk(gw)
    ids = [create(client, False) for _ in range(4)]  # two on each backend
    for rid in ids:
        owner = rid[5]
        got = client.responses.retrieve(rid)
        assert got.id == rid and got.metadata == {"backend": owner}
        with httpx.stream("GET", f"{gw.url}/v1/responses/{rid}?stream=true", timeout=20) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(r.iter_raw())
        assert raw.startswith(b"event: response.completed\ndata: ") and rid.encode() in raw
        items = client.responses.input_items.list(rid)
        assert items.data == []
        assert client.responses.cancel(rid).status == "cancelled"
        client.responses.delete(rid)
        other = fleet["b" if owner == "a" else "a"][1]
        assert rid not in fleet[owner][1].store
        assert all(rid not in path for _, path in other.asked), other.asked
        with pytest.raises(openai.NotFoundError) as e:  # deleted: its backend's own 404
            client.responses.retrieve(rid)
        assert e.value.body["message"] == f"Response with id '{rid}' not found."


def test_responses_unknown_id_is_asked_of_each_backend(backends, gateway):
    """An id the gateway never saw (created before it started) is found on the backend
    that holds it, then remembered; one nobody holds gets a backend's own 404."""
    fleet = stateful(backends, "a", "b")
    gw = start(gateway, fleet, False)
    direct = httpx.post(fleet["b"][0].url + "/v1/responses",
                        json={"model": "m1", "input": "hi"}, timeout=10).json()["id"]
    client = sdk(gw)
    assert client.responses.retrieve(direct).metadata == {"backend": "b"}
    a_asked = len(fleet["a"][1].asked)
    follow = create(client, False, previous_response_id=direct)  # now known: pinned
    assert follow.startswith("resp_b")
    assert client.responses.retrieve(direct).id == direct
    assert len(fleet["a"][1].asked) == a_asked  # not asked again
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_nowhere")
    assert e.value.body["param"] == "response_id"


def test_responses_owner_gone_gets_a_404_that_says_so(backends, gateway):
    """A follow-up whose backend is not serving, and a by-id call on a backend restarted
    since (its store is gone), get an OpenAI-shaped 404 naming that backend; a draining
    owner still answers by-id calls."""
    fleet = stateful(backends, "a", "b")
    gw = start(gateway, fleet, False)
    client = sdk(gw)
    rid = next(r for r in (create(client, False) for _ in range(2)) if r.startswith("resp_a"))
    r = httpx.post(gw.url + "/admin/backends/a/drain", json={"deadline_s": 0}, timeout=5)
    assert r.status_code == 202, r.text
    with pytest.raises(openai.NotFoundError) as e:
        create(client, False, previous_response_id=rid)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == "previous_response_id"
    assert "'a'" in err["message"] and "not serving" in err["message"], err
    assert client.responses.retrieve(rid).id == rid  # draining: its store is still there
    assert httpx.post(gw.url + "/admin/backends/a/undrain", timeout=5).status_code == 200
    assert httpx.post(gw.url + "/admin/backends/a/preempt", json={"deadline_s": 0},
                      timeout=5).status_code == 202
    a = gw.gateway.fleet.get("a")
    assert wait_for(lambda: any(t.to_state == "cold" for t in a.history), 10), a.history
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(rid)
    err = e.value.body
    assert err["param"] == "response_id" and "'a'" in err["message"], err
    assert "restarted" in err["message"], err


# ---- by-id calls: hung backends, the key's limits, a backend's 429, the path as sent ----

BY_ID_CALLS = [  # (method, path after the id, what the client asks)
    pytest.param("GET", "", id="get"),
    pytest.param("GET", "?stream=true", id="get-stream"),
    pytest.param("POST", "/cancel", id="cancel"),
    pytest.param("GET", "/input_items", id="input-items"),
    pytest.param("DELETE", "", id="delete"),
]


def by_id(gw, method: str, rid: str, tail: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/v1/responses/{rid}{tail}", timeout=60, **kw)


@pytest.mark.parametrize("method,tail", BY_ID_CALLS[:3])
def test_responses_by_id_call_moves_on_from_a_hung_backend(backends, gateway, method, tail):
    """A by-id call waited the whole ``proxy.ttfb_timeout_s`` (then a 504) on a backend that
    accepts connections and answers nothing, although the gateway judged it hung (unhealthy,
    backend_hung) after ~2 s: an unknown id must move on to the next backend, a known owner's
    call get a 503 saying so; once judged, its calls are answered without asking it."""
    hang = {"on": False}
    store_a, store_b = ResponsesStore("a"), ResponsesStore("b")

    def hanging(script):
        async def run(req: Received, conn: Conn) -> None:
            if hang["on"]:
                await conn.sleep(120)
                return
            await script(req, conn)
        return run

    a = ScriptedBackend(hanging(store_a.script))
    a.control = hanging(a._default_control)
    a.start()
    b = backends(store_b.script)
    try:
        gw = gateway({"a": a, "b": b}, routing={"policy": "round_robin"},
                     proxy={"ttfb_timeout_s": 30})
        client = sdk(gw)
        on_a = next(r for r in (create(client, False) for _ in range(2)) if r.startswith("resp_a"))
        on_b = httpx.post(b.url + "/v1/responses", json={"model": "m1", "input": "hi"},
                          timeout=10).json()["id"]  # unknown to the gateway
        hang["on"] = True
        got: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda k=k, rid=rid: got.__setitem__(
            k, by_id(gw, method, rid, tail))) for k, rid in (("a", on_a), ("b", on_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got["b"].status_code == 200, (got["b"].status_code, got["b"].text[:300])
        assert on_b in got["b"].text
        assert got["a"].status_code == 503, (got["a"].status_code, got["a"].text[:300])
        err = got["a"].json()["error"]
        assert err["param"] == "response_id" and "'a'" in err["message"], err
        assert "hung" in err["message"] and "retry-after" in got["a"].headers
        assert gw.gateway.fleet.get("a").state == "unhealthy"
        asked = len(a.data_requests)
        again = by_id(gw, method, on_a, tail)  # judged hung: not asked
        assert again.status_code == 503 and len(a.data_requests) == asked, again.text
    finally:
        hang["on"] = False
        a.stop()


@pytest.mark.parametrize("batcher", BATCHER)
@pytest.mark.parametrize("method,tail", BY_ID_CALLS)
def test_responses_by_id_calls_count_against_the_keys_rate_limit(
        backends, gateway, batcher, method, tail):
    """A key with rpm 2 sent 20 GETs of unknown ids: all were served (60 backend requests on a
    fleet of 3). A by-id call is a request of its key: the third in the minute gets the entry
    layer's 429 (retry-after, x-ratelimit-*), and no backend is asked."""
    fleet = stateful(backends, "a", "b", "c")
    gw = start(gateway, fleet, batcher,
               auth={"client_keys": [{"name": "tiny", "key": "k1", "rpm": 2}]})
    auth = {"authorization": "Bearer k1"}
    got = []
    for i in range(3):
        asked = sum(len(s.asked) for _, s in fleet.values())
        got.append(by_id(gw, method, f"resp_guess{i}", tail, headers=auth))
    assert [r.status_code for r in got] == [404, 404, 429], [r.text[:200] for r in got]
    for r in got[:2]:  # the backends' own 404 (nobody holds it), with the key's headers
        assert r.headers["x-ratelimit-limit-requests"] == "2", dict(r.headers)
    assert [r.headers["x-ratelimit-remaining-requests"] for r in got] == ["1", "0", "0"]
    r = got[2]
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
    assert int(r.headers["retry-after"]) >= 1, dict(r.headers)
    assert sum(len(s.asked) for _, s in fleet.values()) == asked


@pytest.mark.parametrize("known", [False, True], ids=["unknown-id", "known-id"])
@pytest.mark.parametrize("method,tail", BY_ID_CALLS)
def test_responses_by_id_429_without_retry_after_gets_the_gateways(
        backends, gateway, known, method, tail):
    """A backend's 429 without Retry-After on a by-id call reached the client with none (every
    other route adds the gateway's retry-after / retry-after-ms): the client must be told
    when; the backend's own body is kept."""
    store = ResponsesStore("a")
    busy = {"on": False}
    body = error_obj("Too many requests", 429, "TooManyRequests")

    async def script(req: Received, conn: Conn) -> None:
        if busy["on"]:
            await conn.send_json(429, body)
            return
        await store.script(req, conn)

    gw = gateway({"a": backends(script)}, retry={"default_retry_after_s": 5})
    rid = create(sdk(gw), False) if known else "resp_unknown"
    busy["on"] = True
    r = by_id(gw, method, rid, tail)
    assert r.status_code == 429 and r.json() == body, r.text
    assert "retry-after" in r.headers, dict(r.headers)
    assert 1 <= int(r.headers["retry-after"]) <= 5, dict(r.headers)
    assert int(r.headers["retry-after-ms"]) <= 5000, dict(r.headers)


def _raw(url: str, line: str) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(f"{line} HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                  .encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def test_responses_by_id_path_is_forwarded_encoded(backends, gateway):
    """The id was forwarded decoded: ``GET /v1/responses/..`` reached the backend as
    ``GET /v1/``, ``POST /v1/responses/../cancel`` as ``POST /v1/cancel``, ``%3F`` became a
    query, ``%23`` cut the id, and such ids were remembered. The backend must receive exactly
    ``/v1/responses/<the id, encoded>``; a dot-segment id is refused without asking it; only
    ids a backend's answer names are remembered."""
    fleet = stateful(backends, "a")
    gw = start(gateway, fleet, False)
    a, _ = fleet["a"]
    rid = create(sdk(gw), False)
    for line in ["GET /v1/responses/..", "POST /v1/responses/../cancel",
                 "DELETE /v1/responses/.", "GET /v1/responses/%2E%2E",
                 "GET /v1/responses/%2e/input_items",
                 # no by-id route has this shape once decoded (an id with a "/" and a route)
                 "POST /v1/responses/..%2Fcancel/cancel", "POST /v1/responses/x%2Fcancel",
                 "DELETE /v1/responses/..%2Fcancel"]:
        n = len(a.data_requests)
        status, body = _raw(gw.url, line)
        assert status in (400, 404, 405), (line, status, body)
        err = json.loads(body)["error"]
        assert err["type"] == "invalid_request_error", err
        assert status != 400 or err["param"] == "response_id", err
        assert len(a.data_requests) == n, (line, a.data_requests[n:])
    sent = {  # what the client sends -> what the backend must receive
        f"GET /v1/responses/{rid}%3Fstream=true": f"GET /v1/responses/{rid}%3Fstream=true",
        f"GET /v1/responses/{rid}%23frag": f"GET /v1/responses/{rid}%23frag",
        "GET /v1/responses/x%2Finput_items": "GET /v1/responses/x%2Finput_items",
        "GET /v1/responses/r%C3%A9p%20x%25%2B": "GET /v1/responses/r%C3%A9p%20x%25%2B",
        f"GET /v1/responses/{rid}?stream=true": f"GET /v1/responses/{rid}?stream=true",
    }
    for line, want in sent.items():
        n = len(a.data_requests)
        status, _ = _raw(gw.url, line)
        got = [f"{q.method} {q.path}" for q in a.data_requests[n:]]
        assert got == [want], (line, got)
        assert status == (200 if line.endswith("?stream=true") else 404), (line, status)
    assert len(gw.gateway.responses.owners) == 1  # the one created; no odd id remembered


def test_responses_by_id_refusal_is_logged_with_its_method(backends, gateway, caplog):
    """The gateway's own refusals of GET and DELETE by id were logged as ``POST ...``."""
    fleet = stateful(backends, "a")
    gw = start(gateway, fleet, False, auth={"client_keys": [{"name": "n", "key": "k1"}]})
    caplog.set_level(logging.INFO, logger="gateway.api")
    for method in ("GET", "DELETE"):
        r = by_id(gw, method, "resp_x", "", headers={"authorization": "Bearer wrong",
                                                     "x-request-id": f"req-{method}"})
        assert r.status_code == 401, r.text
        logged = [rec.getMessage() for rec in caplog.records if f"req-{method}" in rec.getMessage()]
        assert logged and all(m.startswith(f"{method} /v1/responses/") for m in logged), logged
