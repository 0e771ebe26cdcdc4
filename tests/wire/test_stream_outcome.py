"""Issue 13, kind 2: every stream's outcome is classified, for every streaming endpoint.

A 200 stream ends one of three ways:

* complete: ``data: [DONE]`` (chat, completions) or a Responses API terminal event
  (``response.completed`` / ``response.incomplete``);
* in-band error: the backend reported a request error inside the stream (vLLM's
  ``data: {"error": {...}}``, usually then ``[DONE]``; the Responses API's ``event: error``
  or ``response.failed``): relayed as sent, counted under the error's status and attempt
  outcome ``in_band_error``, logged with the request id, never charged to the breaker;
* incomplete: the body ended without its end: the client gets the gateway's error event,
  it is counted as a cut stream and charged to the breaker.

Scripted backends, the real gateway under uvicorn, raw bytes through httpx (the relay must
not change them) and the ``openai`` SDK where the client's view matters.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest

from gateway.config import VLLM_PASSTHROUGH_PATHS
from tests.support.scripted import Conn, Received, chunk_obj, wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
CUSTOM = "/v1/custom/stream"  # a pass-through route added in the config, that streams
BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
    COMPLETIONS: {"model": "m1", "prompt": "hi", "max_tokens": 16},
    RESPONSES: {"model": "m1", "input": "hi"},
    CUSTOM: {"model": "m1", "input": "hi"},
}
DONE = b"data: [DONE]\n\n"


def data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def rsp(kind: str, **fields: Any) -> bytes:
    """A Responses API event as vLLM and OpenAI frame it: ``event:`` then ``data:``."""
    return f"event: {kind}\n".encode() + data({"type": kind, **fields})


def response_obj(status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": "m1",
            "status": status, "error": error, "incomplete_details": None, "output": []}


def text_event(path: str, text: str) -> bytes:
    if path in (RESPONSES, CUSTOM):
        return rsp("response.output_text.delta", item_id="msg_1", output_index=0,
                   content_index=0, delta=text, sequence_number=2)
    if path == COMPLETIONS:
        return data({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
                     "choices": [{"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": None}]})
    return data(chunk_obj(content=text))


def vllm_error(message: str, code: int) -> bytes:
    """vLLM's in-band error (``create_streaming_error_response``)."""
    return data({"error": {"message": message, "type": "BadRequestError", "param": None,
                           "code": code}})


def streaming(events: list[bytes], ending: str = "fin"):
    """Data plane: a 200 event stream of ``events``, then the body ends cleanly (``fin``:
    the chunked terminator) or the connection is reset (``rst``)."""

    async def script(req: Received, conn: Conn) -> None:
        await conn.start_stream()
        for e in events:
            await conn.chunk(e)
        if ending == "rst":
            await conn.sleep(0.05)
            conn.reset()
        else:
            await conn.write(b"0\r\n\r\n")

    return script


def start(gateway, a, path: str, batcher: bool):
    sections: dict[str, Any] = {}
    if path == CUSTOM:
        sections["proxy"] = {"passthrough_paths": [*VLLM_PASSTHROUGH_PATHS, CUSTOM]}
    if batcher:
        sections["batcher"] = {"enabled": True}
    return gateway({"a": a}, **sections)


def stream_raw(gw, path: str, rid: str) -> bytes:
    with httpx.stream("POST", gw.url + path, json={**BODIES[path], "stream": True},
                      headers={"x-request-id": rid}, timeout=30) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())


def attempts(g, outcome: str) -> float:
    return g.metrics.upstream_attempts.labels("a", outcome)._value.get()


def requests(g, path: str, status: int) -> float:
    return g.metrics.requests.labels(path, "m1", str(status), "")._value.get()


def stream_errors(g) -> float:
    return sum(s.value for m in g.metrics.stream_errors.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["backend"] == "a")


BATCHER = pytest.mark.parametrize("batcher", [False, True], ids=["batcher_off", "batcher_on"])

# (path, the backend's events, the error message, the status it is counted under)
IN_BAND = {
    "chat": (CHAT, [data(chunk_obj(role="assistant", content="")), text_event(CHAT, "Hel"),
                    vllm_error("This model's maximum context length is 16 tokens.", 400),
                    DONE], "This model's maximum context length is 16 tokens.", 400),
    "completions": (COMPLETIONS, [text_event(COMPLETIONS, "Hel"),
                                  vllm_error("Engine crashed while generating.", 500), DONE],
                    "Engine crashed while generating.", 500),
    "responses_error_event": (
        RESPONSES, [rsp("response.created", response=response_obj("in_progress"),
                        sequence_number=0), text_event(RESPONSES, "Hel"),
                    rsp("error", code="invalid_prompt", message="The prompt was refused.",
                        param=None, sequence_number=3)],
        "The prompt was refused.", 500),
    "responses_failed": (
        RESPONSES, [rsp("response.created", response=response_obj("in_progress"),
                        sequence_number=0), text_event(RESPONSES, "Hel"),
                    rsp("response.failed", sequence_number=3, response=response_obj(
                        "failed", {"code": "server_error", "message": "The model failed."}))],
        "The model failed.", 500),
    "passthrough": (CUSTOM, [text_event(CUSTOM, "Hel"), vllm_error("Bad input field.", 422)],
                    "Bad input field.", 422),
    "chat_error_without_done": (CHAT, [text_event(CHAT, "Hel"), vllm_error("Cut off.", 400)],
                                "Cut off.", 400),
    # the error is the stream's first event (read before the client's headers are sent)
    "chat_error_first": (CHAT, [vllm_error("Invalid tool schema.", 400), DONE],
                         "Invalid tool schema.", 400),
}


@BATCHER
@pytest.mark.parametrize("case", list(IN_BAND))
def test_stream_in_band_error_is_counted_and_logged_not_charged(backends, gateway, caplog,
                                                                case, batcher):
    """The backend's error event reaches the client as sent (once, no gateway error
    added; a DONE stream ends with ``[DONE]``); the request is counted under the error's
    status, the attempt as ``in_band_error``, a log line names the request id and the
    message, and the backend's breaker is not charged."""
    path, events, message, status = IN_BAND[case]
    caplog.set_level(logging.INFO, logger="gateway.flow")
    a = backends(streaming(events))
    gw = start(gateway, a, path, batcher)
    g = gw.gateway
    rid = f"req-inband-{case}"
    raw = stream_raw(gw, path, rid)
    assert raw.startswith(events[0])
    for e in events:
        assert raw.count(e) == 1, e  # relayed as sent, once
    assert raw.count(b"error") == b"".join(events).count(b"error")  # no error of ours
    if path in (CHAT, COMPLETIONS):
        assert raw.endswith(DONE) and raw.count(DONE) == 1
    assert wait_for(lambda: attempts(g, "in_band_error") == 1, 5), attempts(g, "ok")
    assert requests(g, path, status) == 1
    assert requests(g, path, 200) == 0 and attempts(g, "ok") == 0
    assert stream_errors(g) == 0
    b = g.fleet.get("a")
    assert b.breaker.consecutive == 0 and b.state.value == "warm"
    logged = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert any(message in line for line in logged), logged


def test_stream_in_band_error_reaches_the_sdk_as_the_backends(backends, gateway):
    """The client's view: the SDK raises on the backend's own error event, message
    intact, after the tokens before it."""
    path, events, message, _ = IN_BAND["chat"]
    gw = start(gateway, backends(streaming(events)), path, batcher=False)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    got = []
    with pytest.raises(openai.APIError) as e:
        for ch in client.chat.completions.create(**BODIES[CHAT], stream=True):
            got.append(ch.choices[0].delta.content)
    assert got == ["", "Hel"] and message in str(e.value)
    g = gw.gateway
    assert wait_for(lambda: attempts(g, "in_band_error") == 1, 5)


NO_END = {
    "responses_no_terminal": [rsp("response.created", response=response_obj("in_progress"),
                                  sequence_number=0),
                              text_event(RESPONSES, "Hel"), text_event(RESPONSES, "lo")],
    "responses_text_done_only": [text_event(RESPONSES, "Hello"),
                                 rsp("response.output_text.done", item_id="msg_1",
                                     output_index=0, content_index=0, text="Hello",
                                     sequence_number=3)],
}


@BATCHER
@pytest.mark.parametrize("case", list(NO_END))
def test_stream_without_its_end_is_incomplete(backends, gateway, case, batcher):
    """A Responses API stream whose body ends cleanly after some deltas but without a
    terminal event is cut short: the client gets an ``event: error``
    (``upstream_incomplete``) after the events as sent, it is counted as a stream error and
    charged to the backend's breaker."""
    events = NO_END[case]
    a = backends(streaming(events))
    gw = start(gateway, a, RESPONSES, batcher)
    g = gw.gateway
    raw = stream_raw(gw, RESPONSES, f"req-noend-{case}")
    assert raw.startswith(b"".join(events))
    tail = raw[len(b"".join(events)):]
    assert tail.startswith(b"event: error\ndata: "), raw
    err = json.loads(tail.split(b"data: ", 1)[1])
    assert err["type"] == "error" and err["code"] == "upstream_incomplete" and err["message"]
    assert wait_for(lambda: attempts(g, "upstream_incomplete") == 1, 5), attempts(g, "ok")
    assert g.metrics.stream_errors.labels("a", "upstream_incomplete")._value.get() == 1
    assert g.fleet.get("a").breaker.consecutive == 1  # charged as a broken stream
    assert attempts(g, "ok") == 0


COMPLETE = {
    # the word "error" in tokens and "error": null in the response object are not errors
    "chat_error_words": (CHAT, [text_event(CHAT, "error"), text_event(CHAT, '{"error": 1}'),
                                data(chunk_obj(finish="stop")), DONE], "fin"),
    "responses_completed": (RESPONSES, [text_event(RESPONSES, "error"),
                                        rsp("response.completed", sequence_number=3,
                                            response=response_obj("completed"))], "fin"),
    "responses_incomplete": (RESPONSES, [text_event(RESPONSES, "Hel"),
                                         rsp("response.incomplete", sequence_number=3,
                                             response=response_obj("incomplete"))], "fin"),
    # the end was relayed: a connection that breaks after it loses nothing
    "responses_completed_then_reset": (RESPONSES, [text_event(RESPONSES, "Hel"),
                                                   rsp("response.completed", sequence_number=3,
                                                       response=response_obj("completed"))],
                                       "rst"),
}


@pytest.mark.parametrize("case", list(COMPLETE))
def test_stream_with_its_end_is_complete(backends, gateway, case):
    """A stream that ends with its end is a success, relayed byte for byte, whatever its
    tokens say."""
    path, events, ending = COMPLETE[case]
    a = backends(streaming(events, ending))
    gw = start(gateway, a, path, batcher=False)
    g = gw.gateway
    raw = stream_raw(gw, path, f"req-complete-{case}")
    assert raw == b"".join(events)
    assert wait_for(lambda: attempts(g, "ok") == 1, 5), attempts(g, "upstream_disconnected")
    assert requests(g, path, 200) == 1 and stream_errors(g) == 0
    assert g.fleet.get("a").breaker.consecutive == 0
