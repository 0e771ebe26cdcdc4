"""A streaming completions request with ``echo: true`` keeps its echoed prompt (issue 17).

Found while trying the feature (r17b-try). To continue completions by token ids, the gateway
sends every continuable stream's first attempt with ``return_token_ids: true``
(``gateway.proxy.continuation.with_token_ids``). vLLM 0.32 drops the echoed prompt's text
when both are set: ``vllm/entrypoints/openai/completion/serving.py``, streaming (line 338)
and non-streaming (line 535)::

    if request.echo and not has_echoed[i]:
        ...
        if request.return_token_ids:
            prompt_text = ""

So through the gateway a client that asks ``echo: true`` (and not ``return_token_ids``) gets
its stream without the prompt text, on a healthy backend, with no failure at all; straight
to vLLM it gets the prompt. The simulator echoes either way, so the sim-based tests cannot
see it. The scripted backend below answers as vLLM 0.32 does.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.scripted import Conn, Received, ScriptedBackend
from tests.support.servers import GatewayThread, gateway_config

PROMPT = "Say hi"
PROMPT_IDS = [101, 102]
TOKENS = [(" Hello", 11), (" there", 12)]


async def vllm_completions(req: Received, conn: Conn) -> None:
    """vLLM 0.32's streaming completions answer, echo included (serving.py's logic)."""
    body = req.json()
    ids = body.get("return_token_ids") is True
    prompt_text = "" if ids else body["prompt"]  # vLLM: echo + return_token_ids -> ""
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m1"}
    await conn.start_stream()
    for i, (text, tid) in enumerate(TOKENS):
        if i == 0 and body.get("echo"):
            text = prompt_text + text
        await conn.event({**head, "choices": [{
            "index": 0, "text": text, "logprobs": None,
            "finish_reason": "length" if i == len(TOKENS) - 1 else None, "stop_reason": None,
            "prompt_token_ids": PROMPT_IDS if ids and i == 0 else None,
            "token_ids": [tid] if ids else None}]})
    await conn.done()
    conn.close()


def text_of(raw: bytes) -> str:
    out = ""
    for e in raw.split(b"\n\n"):
        if e.startswith(b"data: {"):
            for ch in json.loads(e[6:]).get("choices", []):
                out += ch.get("text") or ""
    return out


def test_echo_keeps_the_prompt_through_the_gateway() -> None:
    backend = ScriptedBackend(vllm_completions)
    backend.start()
    gw = GatewayThread(gateway_config([{"id": "a", "url": backend.url}]))
    gw.start()
    try:
        gw.wait_ready(routable=1)
        body: dict[str, Any] = {"model": "m1", "prompt": PROMPT, "max_tokens": 2,
                                "stream": True, "echo": True, "temperature": 0}
        direct = httpx.post(backend.url + "/v1/completions", json=body, timeout=10).content
        assert text_of(direct) == "Say hi Hello there"  # vLLM straight: the prompt echoed
        got = httpx.post(gw.url + "/v1/completions", json=body, timeout=10).content
        assert text_of(got) == "Say hi Hello there"
    finally:
        gw.stop()
        backend.stop()
