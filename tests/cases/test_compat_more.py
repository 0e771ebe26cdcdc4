"""More compatibility promises found by review: Responses API streams (no ``[DONE]``),
``"stream": null``, one ``x-request-id``, and 404 (never a retried 503) for a mistyped model
while some backend is down."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, completion_obj, wait_for

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
