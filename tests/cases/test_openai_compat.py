"""OpenAI API details the gateway must keep: ``stream_options.include_usage`` reaches the
backend and its usage chunk reaches the client exactly once (case BUG-17); ``/v1/models``
is the union of every backend's models, stable from call to call, with vLLM's fields
(case BUG-18); Responses API streams (no ``[DONE]``), ``"stream": null``, one
``x-request-id``, and 404 (never a retried 503) for a mistyped model while some backend is
down."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import (
    CHUNK_ID,
    Conn,
    Received,
    chunk_obj,
    completion_obj,
    default_script,
    models_obj,
    wait_for,
)

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
COMPLETION = {"model": "m1", "prompt": "hi", "max_tokens": 64}
INCLUDE_USAGE = {"stream_options": {"include_usage": True}}

# Usage A reports, per endpoint: (prompt_tokens, completion_tokens).
USAGE_OF = {"/v1/chat/completions": (11, 3), "/v1/completions": (17, 4)}


# ---- BUG-17 --------------------------------------------------------------------------------

def text_chunk(text: str | None = None, finish: str | None = None) -> dict[str, Any]:
    """A ``/v1/completions`` stream chunk like vLLM's."""
    return {"id": "cmpl-scripted", "object": "text_completion", "created": 1, "model": "m1",
            "choices": [{"index": 0, "text": text or "", "logprobs": None,
                         "finish_reason": finish}]}


def usage_chunk(path: str) -> dict[str, Any]:
    p, c = USAGE_OF[path]
    chat = path == "/v1/chat/completions"
    return {"id": CHUNK_ID if chat else "cmpl-scripted",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1, "model": "m1", "choices": [],
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


def vllm_usage_script(die_early: bool = False):
    """Streams like vLLM: the usage-only chunk only when ``include_usage`` was received.
    ``die_early``: RST after two chunks (a failed stream, no usage ever sent)."""

    async def script(req: Received, conn: Conn) -> None:
        body = req.json()
        chat = req.path == "/v1/chat/completions"
        await conn.start_stream()
        parts = ["Hel", "lo", " you"]
        await conn.event(chunk_obj(role="assistant", content="") if chat else text_chunk(""))
        for i, t in enumerate(parts):
            if die_early and i == 1:
                await conn.sleep(0.05)
                conn.reset()
                return
            await conn.event(chunk_obj(content=t) if chat else text_chunk(t))
        await conn.event(chunk_obj(finish="stop") if chat else text_chunk(finish="stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await conn.event(usage_chunk(req.path))
        await conn.done()

    return script


def stream_events(url: str, path: str, body: bytes) -> list[dict[str, Any] | str]:
    with httpx.stream("POST", url + path, content=body, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    out: list[dict[str, Any] | str] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[len(b"data: "):]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def tokens(gw, kind: str) -> float:
    return gw.gateway.metrics.tokens.labels("m1", kind)._value.get()  # type: ignore[no-any-return]


def first_body(path: str, sent: bytes) -> bytes:
    """The body a backend receives: the client's byte for byte, but for a chat or completions
    stream with continuation on (issue 17), which asks vLLM for token ids
    (``return_token_ids``; the client is sent none unless it asked)."""
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return sent
    return json.dumps({**json.loads(sent), "return_token_ids": True}).encode()


def test_BUG_17_include_usage_round_trips(backends, gateway):
    """BUG-17 run 1 on ``/v1/chat/completions`` and ``/v1/completions``: A receives the body
    byte for byte (so ``stream_options`` unchanged); the client gets exactly one usage chunk,
    ``choices: []``, integer counts, after the finish chunk and before ``[DONE]``; the
    gateway's token metrics equal those numbers. The openai SDK sees the same usage.
    (Run 2, "force usage" for the gateway's own accounting, is not tested: the gateway has
    no such mode.)"""
    a = backends(vllm_usage_script())
    gw = gateway({"a": a})
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        sent = json.dumps({**base, "stream": True, **INCLUDE_USAGE}).encode()
        events = stream_events(gw.url, path, sent)
        got = a.data_requests[-1]
        assert got.path == path and got.body == first_body(path, sent)
        assert got.json()["stream_options"] == {"include_usage": True}
        usage = [i for i, e in enumerate(events) if isinstance(e, dict) and e.get("usage")]
        assert len(usage) == 1, events
        u = events[usage[0]]
        assert isinstance(u, dict) and u["choices"] == []
        p, c = USAGE_OF[path]
        assert u["usage"] == {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        assert all(type(v) is int for v in u["usage"].values())
        finish = [i for i, e in enumerate(events) if isinstance(e, dict) and e["choices"]
                  and e["choices"][0]["finish_reason"] == "stop"]
        assert finish == [usage[0] - 1], events  # right after the finish chunk
        assert events[usage[0] + 1:] == ["[DONE]"]
    assert wait_for(lambda: tokens(gw, "prompt") == 11 + 17, 5), tokens(gw, "prompt")
    assert wait_for(lambda: tokens(gw, "completion") == 3 + 4, 5), tokens(gw, "completion")

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(**CHAT, stream=True,
                                                 stream_options={"include_usage": True}))
    with_usage = [ch for ch in chunks if ch.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (11, 3)
    chunks = list(client.completions.create(**COMPLETION, stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.usage.total_tokens for ch in chunks if ch.usage is not None] == [21]
    # counted when the relay finishes, which may be just after the client read [DONE]
    assert wait_for(lambda: tokens(gw, "prompt") == 11 + 17 + 11 + 17, 5), tokens(gw, "prompt")


def test_BUG_17_no_usage_chunk_when_not_asked(backends, gateway):
    """BUG-17 "not leak when not asked": without ``stream_options`` the body reaches A
    without it (the gateway does not add ``include_usage``), the client stream has no usage
    chunk, and no usage is fabricated in the metrics."""
    a = backends(vllm_usage_script())
    gw = gateway({"a": a})
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        sent = json.dumps({**base, "stream": True}).encode()
        events = stream_events(gw.url, path, sent)
        assert a.data_requests[-1].body == first_body(path, sent)
        assert not [e for e in events if isinstance(e, dict) and "usage" in e], events
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert tokens(gw, "prompt") == 0 and tokens(gw, "completion") == 0


def test_BUG_17_no_usage_fabricated_after_failed_stream(backends, gateway):
    """BUG-17 "Must NOT: fabricate usage after a failed stream": with ``include_usage`` asked,
    A breaks the stream before its usage chunk; the client gets the error event (BUG-09) and
    no usage chunk, and the gateway records no tokens."""
    a = backends(vllm_usage_script(die_early=True))
    gw = gateway({"a": a})
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        events = stream_events(gw.url, path,
                               json.dumps({**base, "stream": True, **INCLUDE_USAGE}).encode())
        assert not [e for e in events if isinstance(e, dict) and "usage" in e], events
        assert isinstance(events[-2], dict) and "error" in events[-2]
    assert tokens(gw, "prompt") == 0 and tokens(gw, "completion") == 0


# ---- BUG-18 --------------------------------------------------------------------------------

A_MODELS = models_obj("m1", "m1-lora-sql", parents={"m1-lora-sql": "m1"})
B_MODELS = models_obj("m2", "m1")  # B's own order differs from A's


def models_control(listing: dict[str, Any]):
    async def control(req: Received, conn: Conn) -> None:
        if req.path == "/v1/models":
            await conn.send_json(200, listing)
        else:
            await default_script(req, conn)

    return control


def named(name: str):
    """Data-plane script answering with the backend's name as the content."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.send_json(200, completion_obj(name, model=req.json()["model"]))

    return script


def served_by(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=10,
                   json={**CHAT, "model": model})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def test_BUG_18_models_aggregates_every_backend(backends, gateway):
    """BUG-18 repro: A lists m1 and the LoRA m1-lora-sql (``parent: m1``), B lists m2 and m1,
    with vLLM's fields. 10 calls: each 200, ids exactly {m1, m1-lora-sql, m2}, each once,
    identical answers, cards equal to the backends' own (``max_model_len``, ``root``,
    ``parent``, ``permission`` kept). The SDK lists the same. LoRA requests go only to A
    (B serves m2 only). A down -> {m1, m2}, no error; both down -> 503 OpenAI error with
    ``Retry-After``, not an empty list. Both back -> the LoRA request again only on A."""
    a = backends(named("A"), control=models_control(A_MODELS))
    b = backends(named("B"), control=models_control(B_MODELS))
    gw = gateway({"a": a, "b": b})
    source = {c["id"]: c for c in B_MODELS["data"]} | {c["id"]: c for c in A_MODELS["data"]}

    answers = [httpx.get(gw.url + "/v1/models", timeout=10) for _ in range(10)]
    assert all(r.status_code == 200 for r in answers)
    assert len({r.content for r in answers}) == 1, "the listing changed between calls"
    listing = answers[0].json()
    assert listing["object"] == "list"
    ids = [c["id"] for c in listing["data"]]
    assert sorted(ids) == ["m1", "m1-lora-sql", "m2"], ids  # each id once
    for card in listing["data"]:
        assert card == source[card["id"]]  # vLLM fields preserved
    lora = next(c for c in listing["data"] if c["id"] == "m1-lora-sql")
    assert lora["parent"] == "m1" and lora["max_model_len"] == 4096

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    assert sorted(m.id for m in client.models.list()) == sorted(ids)
    assert client.models.retrieve("m1-lora-sql").id == "m1-lora-sql"

    assert {served_by(gw.url, "m1-lora-sql") for _ in range(6)} == {"A"}
    assert {served_by(gw.url, "m2") for _ in range(6)} == {"B"}
    assert not [r for r in b.data_requests if r.json()["model"] == "m1-lora-sql"]

    a.stop()
    fleet_a = gw.gateway.fleet.get("a")
    for when in ("just stopped", "marked down"):
        if when == "marked down":
            assert wait_for(lambda: fleet_a.state.value == "unhealthy", 5)
        r = httpx.get(gw.url + "/v1/models", timeout=10)
        assert r.status_code == 200, (when, r.text)
        assert sorted(c["id"] for c in r.json()["data"]) == ["m1", "m2"], when

    b.stop()
    fleet_b = gw.gateway.fleet.get("b")
    for when in ("just stopped", "marked down"):
        if when == "marked down":
            assert wait_for(lambda: fleet_b.state.value == "unhealthy", 5)
        r = httpx.get(gw.url + "/v1/models", timeout=10)
        assert r.status_code == 503, (when, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert int(r.headers["retry-after"]) >= 1

    a.restart()
    b.restart()
    t0 = time.monotonic()
    gw.wait_ready(timeout=10, routable=2)
    assert time.monotonic() - t0 < 10
    before_b = len(b.data_requests)
    assert {served_by(gw.url, "m1-lora-sql") for _ in range(4)} == {"A"}
    assert len(b.data_requests) == before_b


# ---- Responses API streams, stream: null, request ids, mistyped models -------------------

RESPONSE_EVENTS = [
    ("response.created", {"type": "response.created", "sequence_number": 0,
                          "response": {"id": "resp_1", "object": "response",
                                       "status": "in_progress"}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1,
                                    "item_id": "msg_1", "output_index": 0, "content_index": 0,
                                    "delta": "hi"}),
    ("response.completed", {"type": "response.completed", "sequence_number": 2,
                            "response": {"id": "resp_1", "object": "response",
                                         "status": "completed"}}),
]


def responses_stream(cut_after: int | None = None):
    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        for i, (event, data) in enumerate(RESPONSE_EVENTS):
            if cut_after is not None and i == cut_after:
                conn.reset()
                return
            await conn.chunk(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        await conn.write(b"0\r\n\r\n")  # the body ends: that is the end of the stream

    return script


def test_responses_stream_ends_without_done_and_is_a_success(backends, gateway):
    """vLLM's /v1/responses streams use ``event:`` lines and never send ``[DONE]``: the
    gateway must relay them unchanged, add nothing, and not count them as failures."""
    a = backends(responses_stream())
    gw = gateway({"a": a}, proxy={"passthrough_paths": ["/v1/responses"]})
    for _ in range(4):  # more than enough to trip a breaker if it were counted as failing
        with httpx.stream("POST", gw.url + "/v1/responses",
                          json={"model": "m1", "input": "hi", "stream": True}) as r:
            raw = b"".join(r.iter_raw())
        assert r.status_code == 200
        expected = b"".join(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode()
                            for e, d in RESPONSE_EVENTS)
        assert raw == expected
    b = gw.gateway.fleet.get("a")
    assert wait_for(lambda: b.breaker.consecutive == 0 and b.state.value == "warm")
    assert gw.gateway.metrics.stream_errors.labels("a", "upstream_incomplete")._value.get() == 0


def test_responses_stream_failure_is_an_error_event_without_done(backends, gateway):
    a = backends(responses_stream(cut_after=2))
    gw = gateway({"a": a}, proxy={"passthrough_paths": ["/v1/responses"]})
    with httpx.stream("POST", gw.url + "/v1/responses",
                      json={"model": "m1", "input": "hi", "stream": True}) as r:
        raw = b"".join(r.iter_raw())
    blocks = raw[:-2].split(b"\n\n")
    assert blocks[-1].startswith(b"event: error\ndata: ")
    err = json.loads(blocks[-1].split(b"data: ", 1)[1])
    assert err["type"] == "error" and err["code"] == "upstream_disconnected" and err["message"]
    assert b"[DONE]" not in raw


def test_stream_null_means_not_streaming(backends, gateway):
    """``"stream": null`` is valid (OpenAI's schema makes it nullable; vLLM answers 200)."""
    a = backends()
    gw = gateway({"a": a})
    r = httpx.post(gw.url + "/v1/chat/completions",
                   json={"model": "m1", "messages": [{"role": "user", "content": "hi"}],
                         "stream": None})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_one_request_id_even_when_the_backend_echoes_it(backends, gateway):
    async def echo(req: Received, conn: Conn) -> None:
        await conn.send_json(200, completion_obj(), {"x-request-id": req.headers["x-request-id"]})

    a = backends(echo)
    gw = gateway({"a": a})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-request-id": "abc-123"})
    assert raw.headers.get_list("x-request-id") == ["abc-123"]
    assert a.data_requests[0].headers["x-request-id"] == "abc-123"


@pytest.mark.parametrize("model", ["gpt-4o", "m2"])
def test_typo_model_is_404_while_another_backend_is_down(backends, gateway, model):
    """One backend answers, one never did (still loading, or dead): a model nobody lists is
    a client mistake, 404 ``model_not_found``, not a 503 that the SDK retries 3 times."""
    a = backends()
    gw = gateway({"a": a, "dead": type("D", (), {"url": "http://127.0.0.1:9"})()},
                 wait_routable=1)
    sent = []
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=2,
                           http_client=openai.DefaultHttpxClient(
                               event_hooks={"request": [lambda r: sent.append(r)]}))
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    assert len(sent) == 1
