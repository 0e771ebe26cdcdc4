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
