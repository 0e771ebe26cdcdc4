"""Kind: multipart routes pass through (issue 13, item 6).

``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (vLLM serves both) take a
``multipart/form-data`` upload. The real ``openai`` SDK sends it; the scripted backend
checks it received the exact bytes the SDK sent, with the same content-type (boundary),
and answers as vLLM does: JSON, or with ``stream=true`` an SSE stream of
``transcription.chunk`` events ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import Conn, Received, ScriptedBackend

AUDIO = b"RIFF" + os.urandom(4000) + b"\r\n--not-a-boundary\r\n" + bytes(range(256)) * 8
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"


def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    """vLLM's ``TranscriptionStreamResponse``."""
    return {"id": "trsc-1", "object": "transcription.chunk", "created": 1, "model": "whisper",
            "choices": [{"delta": {"content": text}, "finish_reason": finish,
                         "stop_reason": None}]}


async def audio_backend(req: Received, conn: Conn) -> None:
    """Answers an audio upload; ``stream`` read from the form as vLLM does."""
    if not req.path.startswith("/v1/audio/"):
        await conn.send_json(404, {"detail": "Not Found"})
        return
    if b'name="stream"\r\n\r\ntrue' in req.body:
        await conn.start_stream()
        await conn.event(chunk("hello "))
        await conn.event(chunk("world", "stop"))
        await conn.done()
    else:
        await conn.send_json(200, {"text": "hello world", "usage": {"type": "duration",
                                                                    "seconds": 1}})


class Sent:
    """The bytes and content-type of each request the SDK sent (an httpx event hook)."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, str]] = []

    def __call__(self, request: httpx.Request) -> None:
        self.requests.append((request.read(), request.headers["content-type"]))


def sdk(gw, sent: Sent) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(timeout=20,
                                                  event_hooks={"request": [sent]}))


def start(backends, gateway, batcher: bool, **sections: Any) -> tuple[ScriptedBackend, Any]:
    be = backends(audio_backend, models=("whisper",))
    if batcher:
        sections["batcher"] = {"enabled": True, "merge": True}
    return be, gateway({"a": be}, **sections)


def assert_forwarded_as_sent(be: ScriptedBackend, sent: Sent, path: str) -> None:
    got = be.data_requests[-1]
    body, ctype = sent.requests[-1]
    assert ctype.startswith("multipart/form-data; boundary=")
    assert got.path == path
    assert got.headers["content-type"] == ctype
    assert got.body == body  # byte for byte
    assert AUDIO in got.body


BATCHER = [pytest.param(False, id="batcher-off"), pytest.param(True, id="batcher-on")]


@pytest.mark.parametrize("batcher", BATCHER)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_multipart_route_passes_through(backends, gateway, stream, batcher):
    """An SDK transcription (stream or not) reaches the backend as the SDK sent it, and
    its answer (a stream as a stream, ending with [DONE]) reaches the SDK."""
    be, gw = start(backends, gateway, batcher)
    sent = Sent()
    client = sdk(gw, sent)
    if stream:
        events = client.audio.transcriptions.create(
            model="whisper", file=("a.wav", AUDIO, "audio/wav"), stream=True)
        got = [e.to_dict() for e in events]
        assert [e["choices"][0]["delta"]["content"] for e in got] == ["hello ", "world"]
    else:
        result = client.audio.transcriptions.create(
            model="whisper", file=("a.wav", AUDIO, "audio/wav"))
        assert result.text == "hello world"
    assert_forwarded_as_sent(be, sent, TRANSCRIPTIONS)


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
@pytest.mark.parametrize("batcher", BATCHER)
def test_multipart_route_passes_through_translations(backends, gateway, batcher):
    """Translations take the same path."""
    be, gw = start(backends, gateway, batcher)
    sent = Sent()
    result = sdk(gw, sent).audio.translations.create(
        model="whisper", file=("a.wav", AUDIO, "audio/wav"))
    assert result.text == "hello world"
    assert_forwarded_as_sent(be, sent, TRANSLATIONS)


def test_multipart_route_stream_is_relayed_as_sent(backends, gateway):
    """The streamed transcription's bytes reach the client as a stream ending [DONE]."""
    _, gw = start(backends, gateway, False)
    files = {"file": ("a.wav", AUDIO, "audio/wav")}
    with httpx.stream("POST", gw.url + TRANSCRIPTIONS, files=files,
                      data={"model": "whisper", "stream": "true"}, timeout=20) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw == (b"data: " + json.dumps(chunk("hello ")).encode() + b"\n\n"
                   + b"data: " + json.dumps(chunk("world", "stop")).encode() + b"\n\n"
                   + b"data: [DONE]\n\n")


@pytest.mark.parametrize("path", [TRANSCRIPTIONS, TRANSLATIONS])
def test_multipart_route_refuses_what_it_cannot_read(backends, gateway, path):
    """No model field: 400 on ``model``; a JSON body: 400 saying a form is expected; a
    body past ``server.max_body_bytes``: 413. None reaches the backend."""
    be, gw = start(backends, gateway, False, server={"max_body_bytes": 8000})
    files = {"file": ("a.wav", AUDIO[:1000], "audio/wav")}
    r = httpx.post(gw.url + path, files=files, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"
    r = httpx.post(gw.url + path, json={"model": "whisper"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "multipart/form-data" in err["message"] and err["type"] == "invalid_request_error"
    r = httpx.post(gw.url + path, files={"file": ("a.wav", AUDIO * 3, "audio/wav")},
                   data={"model": "whisper"}, timeout=10)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert be.data_requests == []


def test_multipart_passthrough_path_is_read_as_a_form(backends, gateway):
    """A multipart route an operator adds to ``proxy.passthrough_paths`` is read as a form
    too (before: 400 invalid_json, the audio parsed as JSON)."""
    be, gw = start(backends, gateway, False,
                   proxy={"passthrough_paths": ["/v1/responses", "/v1/audio/custom"]})
    files = {"file": ("a.wav", AUDIO, "audio/wav")}
    r = httpx.post(gw.url + "/v1/audio/custom", files=files, data={"model": "whisper"},
                   timeout=10)
    assert r.status_code == 200, r.text
    assert AUDIO in be.data_requests[-1].body
