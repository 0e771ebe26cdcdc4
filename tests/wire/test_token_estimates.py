"""Kind 4 of issue 13: token estimates for admission read the request, not its bytes.

Admission charges a client key's tokens-per-minute bucket before a request is sent. It used
to estimate the prompt as the body's bytes / 4, so a chat with one 1 MB base64 image and
``max_tokens: 16`` was "estimated 250066 tokens" and refused for good (``x-should-retry:
false``), and two 200 KB images used a whole minute's 100,000 tokens while the backend
reported 3 prompt tokens each. Now text counts by its length, token-id lists by theirs, each
image / audio / video / file item by a fixed per-item cost (``admission.estimate``), and
once the answer reports its ``usage`` the key is charged that instead of the estimate.

Through real HTTP: a scripted vLLM that reports 3 prompt and 1 completion tokens, the
gateway under uvicorn, the ``openai`` SDK as the client; chat, completions, embeddings, the
Responses API, streaming and not, batcher (and merging) on and off.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.support.scripted import CHUNK_ID, Conn, Received, chunk_obj, completion_obj
from tests.support.servers import GatewayThread

KEY = "sk-client-1"
PROMPT, COMPLETION = 3, 1  # what the backend reports for each prompt
BATCHER = {"batcher": {"enabled": True}}
N_MERGED = 4
MERGING = {
    "batcher": {
        "enabled": True,
        "predictive": False,
        "normal": {"max_batch_size": N_MERGED, "max_wait_ms": 3000},
    }
}


def b64(size: int, mime: str) -> tuple[str, str]:
    """``size`` bytes as base64, and as a ``data:`` URL of type ``mime``."""
    data = base64.b64encode(bytes(range(256)) * (size // 256)).decode()
    return data, f"data:{mime};base64,{data}"


# ---- the scripted backend: vLLM's answers, each reporting its usage ------------------------

def _count(value: Any) -> int:
    """Prompts (inputs) in a completions ``prompt`` / embeddings ``input``."""
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return 1


def _response(status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 1, "model": "m1", "status": status,
        "output": [] if usage is None else [
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "ok", "annotations": []}]}],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": usage,
    }


RESPONSES_USAGE = {"input_tokens": PROMPT, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": COMPLETION,
                   "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": PROMPT + COMPLETION}


async def reporting(req: Received, conn: Conn) -> None:
    """Every endpoint answers, stream or not, reporting ``PROMPT`` prompt tokens and
    ``COMPLETION`` completion tokens per prompt (a chat stream only when asked with
    ``stream_options.include_usage``, as vLLM does)."""
    body = req.json()
    stream = body.get("stream") is True
    if req.path == "/v1/chat/completions" and not stream:
        await conn.send_json(200, completion_obj("ok", prompt_tokens=PROMPT,
                                                 completion_tokens=COMPLETION))
    elif req.path == "/v1/chat/completions":
        await conn.start_stream()
        await conn.event(chunk_obj(role="assistant", content=""))
        await conn.event(chunk_obj(content="ok"))
        await conn.event(chunk_obj(finish="stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await conn.event({"id": CHUNK_ID, "object": "chat.completion.chunk", "created": 1,
                              "model": "m1", "choices": [],
                              "usage": {"prompt_tokens": PROMPT,
                                        "completion_tokens": COMPLETION,
                                        "total_tokens": PROMPT + COMPLETION}})
        await conn.done()
    elif req.path == "/v1/completions":
        n = _count(body["prompt"])
        await conn.send_json(200, {
            "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
            "choices": [{"index": i, "text": "ok", "logprobs": None, "finish_reason": "stop"}
                        for i in range(n)],
            "usage": {"prompt_tokens": PROMPT * n, "completion_tokens": COMPLETION * n,
                      "total_tokens": (PROMPT + COMPLETION) * n}})
    elif req.path == "/v1/embeddings":
        n = _count(body["input"])
        await conn.send_json(200, {
            "id": "embd-1", "object": "list", "created": 1, "model": "m1",
            "data": [{"index": i, "object": "embedding", "embedding": [0.5, 0.5]}
                     for i in range(n)],
            "usage": {"prompt_tokens": PROMPT * n, "total_tokens": PROMPT * n,
                      "completion_tokens": 0, "prompt_tokens_details": None}})
    elif req.path not in ("/v1/responses", "/v1/chat/completions"):  # pooling, tokenizer
        await conn.send_json(200, {"id": "x-1", "object": "list", "model": "m1", "data": [],
                                   "usage": {"prompt_tokens": PROMPT,
                                             "total_tokens": PROMPT}})
    elif req.path == "/v1/responses" and not stream:
        await conn.send_json(200, _response("completed", RESPONSES_USAGE))
    else:  # a Responses API stream: created, one delta, completed (with the usage)
        await conn.start_stream()
        events = [
            {"type": "response.created", "sequence_number": 0,
             "response": _response("in_progress", None)},
            {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "ok", "logprobs": []},
            {"type": "response.completed", "sequence_number": 2,
             "response": _response("completed", RESPONSES_USAGE)},
        ]
        for e in events:
            await conn.chunk(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())
        await conn.write(b"0\r\n\r\n")


# ---- requests through the openai SDK -------------------------------------------------------

def sdk(gw: GatewayThread, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def chat_parts(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, *parts]}]


def image_part(size: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": b64(size, "image/png")[1]}}


def chat(parts: list[dict[str, Any]], stream: bool = False, usage: bool = True
         ) -> Callable[[openai.OpenAI], Any]:
    """A chat request with content ``parts``, ``max_tokens`` 16 (a stream asks for its usage
    unless ``usage`` is False); returns the raw response (headers and body read)."""
    def send(client: openai.OpenAI) -> Any:
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream and usage \
            else {}
        raw = client.chat.completions.with_raw_response.create(
            model="m1", messages=chat_parts(*parts), max_tokens=16, stream=stream, **extra)
        if stream:
            assert [c for c in raw.parse()]  # read to its end
        else:
            assert raw.parse().choices[0].message.content == "ok"
        return raw

    return send


def responses(content: list[dict[str, Any]], stream: bool = False
              ) -> Callable[[openai.OpenAI], Any]:
    """A Responses API request with one user message of ``content`` items."""
    def send(client: openai.OpenAI) -> Any:
        raw = client.responses.with_raw_response.create(
            model="m1", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "What is in it?"}, *content]}],
            max_output_tokens=16, stream=stream)
        if stream:
            kinds = [e.type for e in raw.parse()]
            assert kinds[-1] == "response.completed", kinds
        else:
            assert raw.parse().output_text == "ok"
        return raw

    return send


def completions(prompt: Any) -> Callable[[openai.OpenAI], Any]:
    def send(client: openai.OpenAI) -> Any:
        raw = client.completions.with_raw_response.create(model="m1", prompt=prompt,
                                                           max_tokens=16)
        assert raw.parse().choices[0].text == "ok"
        return raw

    return send


def embeddings(inputs: Any) -> Callable[[openai.OpenAI], Any]:
    def send(client: openai.OpenAI) -> Any:
        raw = client.embeddings.with_raw_response.create(model="m1", input=inputs,
                                                          encoding_format="float")
        assert raw.parse().data[0].embedding == [0.5, 0.5]
        return raw

    return send


MB = 1_000_000
TOKEN_IDS = list(range(100_000, 160_000))  # 60,000 ids, 8 bytes each in JSON: ~480 KB
LARGE_MEDIA = {
    "chat-image": chat([image_part(MB)]),
    "chat-image-stream": chat([image_part(MB)], stream=True),
    "chat-audio": chat([{"type": "input_audio",
                         "input_audio": {"data": b64(MB, "audio/wav")[0], "format": "wav"}}]),
    "chat-video": chat([{"type": "video_url", "video_url": {"url": b64(MB, "video/mp4")[1]}}]),
    "chat-file": chat([{"type": "file", "file": {"file_data": b64(MB, "application/pdf")[1],
                                                 "filename": "scan.pdf"}}]),
    "responses-image": responses([{"type": "input_image", "detail": "auto",
                                   "image_url": b64(MB, "image/jpeg")[1]}]),
    "responses-file-stream": responses([{"type": "input_file", "filename": "scan.pdf",
                                         "file_data": b64(MB, "application/pdf")[1]}],
                                       stream=True),
    "completions-token-ids": completions([TOKEN_IDS]),
    "embeddings-token-ids": embeddings(TOKEN_IDS),
}


@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
@pytest.mark.parametrize("case", list(LARGE_MEDIA))
def test_token_estimate_reads_the_request_not_its_bytes(backends, gateway, case, batcher):
    """Under ``admission.default_tpm`` 100,000 a request carrying one 1 MB medium (1.33 MB of
    base64) or 60,000 token ids (about 480 KB of JSON) and ``max_tokens`` 16 is admitted and
    answered: the medium costs its per-item estimate, the ids one token each. Text is still
    read by its length: the same request with its medium replaced by as much text is refused
    for good (``x-should-retry: false``, ``type: tokens``) without reaching the backend."""
    a = backends(reporting)
    gw = gateway({"a": a}, admission={"default_tpm": 100_000},
                 **(MERGING if batcher else {}))
    client = sdk(gw)
    raw = LARGE_MEDIA[case](client)
    assert raw.status_code == 200
    assert int(raw.headers["x-ratelimit-limit-tokens"]) == 100_000
    assert len(a.data_requests) == 1

    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m1", max_tokens=16, messages=[
            {"role": "user", "content": "x" * (4 * 100_000)}])  # 100,000 + 16 tokens
    r = info.value.response
    assert r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["type"] == "tokens"
    assert len(a.data_requests) == 1


TPM = 2000
TEXT = "The quick brown fox jumps over the lazy dog. " * 60  # 2700 bytes: 675 tokens
IMAGE_200KB = image_part(200_000)
SETTLED = {
    "chat": chat([IMAGE_200KB]),
    "chat-stream": chat([IMAGE_200KB], stream=True),
    "responses": responses([{"type": "input_image", "image_url": b64(200_000, "image/png")[1]}]),
    "responses-stream": responses([{"type": "input_image",
                                    "image_url": b64(200_000, "image/png")[1]}], stream=True),
    "completions": completions(TEXT),
    "embeddings": embeddings(TEXT),
}


def remaining_tokens(gw: GatewayThread) -> int:
    """The key's remaining tokens after a small non-stream chat of its own (settled with
    its reported usage before its headers go out)."""
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    return int(raw.headers["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize("batcher", [False, True], ids=["batcher-off", "batcher-on"])
@pytest.mark.parametrize("case", list(SETTLED))
def test_token_estimate_is_settled_with_the_reported_usage(backends, gateway, case, batcher):
    """A key with ``tpm`` 2000. Each request (200 KB images for chat and the Responses API,
    2700 bytes of text for completions and embeddings) is estimated at about 700 to 800
    tokens, so three in a row would exhaust the key on estimates alone; the backend reports
    3 prompt and 1 completion tokens each, the key is charged that after each answer
    (non-stream body, the stream's usage event, the Responses API's ``response.completed``),
    and five in a row pass. ``x-ratelimit-remaining-tokens`` then shows the reported usage
    taken, not the estimates."""
    a = backends(reporting)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": TPM}]},
                 **(BATCHER if batcher else {}))
    client = sdk(gw)
    for _ in range(5):
        assert SETTLED[case](client).status_code == 200
    assert len(a.data_requests) == 5
    # six requests of at most PROMPT + COMPLETION tokens each (the refill only adds)
    assert remaining_tokens(gw) >= TPM - 6 * (PROMPT + COMPLETION)


@pytest.mark.parametrize("endpoint", ["completions", "embeddings"])
def test_token_estimate_is_settled_for_each_member_of_a_merged_request(
        backends, gateway, endpoint):
    """With merging on, four concurrent requests (about 690 tokens estimated each, 2760 in
    all, under a key's ``tpm`` 3000) become one upstream request; each member is charged its
    share of the merged answer's usage, so a second round of four is admitted too (on
    estimates alone it would be refused)."""
    a = backends(reporting)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 3000}]},
                 **MERGING)
    send = SETTLED[endpoint]
    client = sdk(gw)
    for _ in range(2):
        with ThreadPoolExecutor(N_MERGED) as pool:
            answers = list(pool.map(lambda _: send(client), range(N_MERGED)))
        assert [r.status_code for r in answers] == [200] * N_MERGED
    assert len(a.data_requests) < 2 * N_MERGED, "merged upstream"
    assert remaining_tokens(gw) >= 3000 - (2 * N_MERGED + 1) * (PROMPT + COMPLETION)


@pytest.mark.parametrize("path,body", [
    ("/v1/score", {"text_1": "a question", "text_2": ["one answer", "another"]}),
    ("/v1/rerank", {"query": "a question", "documents": ["one answer", "another"]}),
    ("/pooling", {"input": "some text"}),
    ("/classify", {"input": ["some text"]}),
    ("/tokenize", {"prompt": "some text"}),
], ids=["score", "rerank", "pooling", "classify", "tokenize"])
def test_token_estimate_charges_no_completion_to_routes_that_generate_nothing(
        backends, gateway, path, body):
    """vLLM's pooling and tokenizer routes (pass-through) generate nothing: a few words
    are estimated at a few tokens, not at the 256-token default completion budget, so a
    key with ``tpm`` 200 may send them (before: 'estimated 264 tokens exceed' for good)."""
    a = backends(reporting)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": 200}]})
    r = httpx.post(gw.url + path, json={"model": "m1", **body},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 200 - PROMPT
    assert [q.path for q in a.data_requests] == [path]


def test_token_estimate_stands_when_the_answer_reports_no_usage(backends, gateway):
    """A chat stream that does not ask for its usage reports none: the key keeps paying the
    estimate (two images, 2 x 765 tokens, plus text and ``max_tokens``), not nothing."""
    a = backends(reporting)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": TPM}]})
    raw = chat([IMAGE_200KB, IMAGE_200KB], stream=True, usage=False)(sdk(gw))
    assert raw.status_code == 200
    left = remaining_tokens(gw)
    # the estimate (~1560) taken, and the probe's 4; the bucket refills 33 tokens a second,
    # so this holds for the half minute after the stream
    assert left < TPM - 500, left


# ---- usage the gateway does not believe, and requests no backend served ----------------

def absurd(req: Received, conn: Conn) -> Any:
    """A backend reporting 10**12 prompt tokens for every chat answer."""
    return conn.send_json(200, completion_obj("ok", prompt_tokens=10**12, completion_tokens=1))


def test_token_estimate_stands_when_the_usage_is_absurd(backends, gateway):
    """A backend reports ``prompt_tokens`` 10**12: the gateway neither counts it in
    ``gateway_tokens_total`` nor charges it to the key (which would lock the key out for a
    minute): the estimate stands, and the key's next requests pass."""
    a = backends(absurd)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY, "tpm": TPM}]})
    client = sdk(gw)
    for _ in range(3):
        r = client.chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=16)
        assert r.status_code == 200
        assert int(r.headers["x-ratelimit-remaining-tokens"]) > TPM // 2
    assert gw.gateway.metrics.tokens.labels("m1", "prompt")._value.get() == 0


def test_token_estimate_is_given_back_when_no_backend_served(backends, gateway):
    """The backend answers 429 ``Retry-After: 1`` (or a 503, or a 400): nothing was
    generated, so the key pays no tokens for it. A key with ``tpm`` 10000 sending
    ``max_tokens`` 4000 (an estimate of about 4000 tokens each) is not exhausted by three
    refused requests: the fourth, answered, shows nearly the whole bucket left."""
    answers = iter([(429, {"retry-after": "1"}), (503, {}), (400, {})])

    async def refusing(req: Received, conn: Conn) -> None:
        nxt = next(answers, None)
        if nxt is None:
            await conn.send_json(200, completion_obj("ok", prompt_tokens=PROMPT,
                                                     completion_tokens=COMPLETION))
            return
        status, headers = nxt
        await conn.send_json(status, {"error": {"message": "no", "type": "x", "param": None,
                                                "code": status}}, headers)

    a = backends(refusing)
    gw = gateway({"a": a}, auth={"client_keys": [{"name": "one", "key": KEY,
                                                  "tpm": 10_000}]})
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4000}
    headers = {"authorization": f"Bearer {KEY}"}
    for status in (429, 503, 400):
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers,
                       timeout=10)
        assert r.status_code == status, r.text
        assert int(r.headers["x-ratelimit-remaining-tokens"]) > 9000, r.headers
        if status == 429:
            time.sleep(1.1)  # the backend's own Retry-After: it cools until then
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ratelimit-remaining-tokens"]) >= 10_000 - 2 * (PROMPT + COMPLETION)
