"""``continuous_usage_stats`` without ``include_usage`` across a continuation (issue 17).

Found while trying the feature (r17b-try). vLLM 0.32 sends per-chunk usage only when
``include_usage`` is true too (``vllm/entrypoints/serve/utils/api_utils.py``
``should_include_usage``: ``include_continuous_usage = include_usage and
continuous_usage_stats``); a client that sent ``{"continuous_usage_stats": true}`` alone gets
no usage at all. The continuation is always sent with ``include_usage: true`` (the stitcher
sums it) and keeps ``continuous_usage_stats``, so the next backend puts a usage object on
every chunk; the stitcher drops only the final usage chunk, so the client sees ``usage``
appear on every chunk after the seam: not the stream it would have had. (The simulator sends
per-chunk usage on ``continuous_usage_stats`` alone, unlike vLLM, so the sim-based tests
cannot see it.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.broken_streams import Leg, Plan, Rig, make_rig, send, stop_rig

CHAT = "/v1/chat/completions"
TOKENS = [("Hello", 11), (" there", 12), (" friend", 13), (" again", 14)]


def enc(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chat_events(ident: str, first: int, *, include_usage: bool, continuous: bool,
                prompt: int) -> list[bytes]:
    """vLLM 0.32's chat stream from token ``first`` (ids asked, as the gateway asks): the role
    chunk, a chunk per token, EOS; usage per chunk only when ``include_usage`` and
    ``continuous``, the usage chunk only when ``include_usage``."""
    head = {"id": ident, "object": "chat.completion.chunk", "created": 1, "model": "m1"}
    per_chunk = include_usage and continuous
    out, n = [], 0

    def u(k: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + k, "completion_tokens": k}

    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": list(range(prompt)), "prompt_text": None}
    if per_chunk:
        role["usage"] = u(0)
    out.append(enc(role))
    for text, tid in [*TOKENS[first:], ("", 2)]:
        n += 1
        last = tid == 2
        obj = {**head, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                    "finish_reason": "stop" if last else None,
                                    "token_ids": [tid]}]}
        if per_chunk:
            obj["usage"] = u(n)
        out.append(enc(obj))
    if include_usage:
        out.append(enc({**head, "choices": [], "usage": u(n)}))
    return [*out, b"data: [DONE]\n\n"]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = make_rig(None)
    yield r
    stop_rig(r)


def test_continuous_usage_alone_gets_no_usage_after_the_seam(rig: Rig) -> None:
    first = chat_events("chatcmpl-a", 0, include_usage=False, continuous=True, prompt=5)
    cut = sum(map(len, first[:3]))  # role chunk + 2 tokens
    has = len(b"".join(first[:3]).replace(b"[11]", b"null").replace(b"[12]", b"null")
              .replace(b'"prompt_token_ids":[0,1,2,3,4]', b'"prompt_token_ids":null'))
    # the continuation is asked with include_usage: true (and continuous_usage_stats kept)
    rest = chat_events("chatcmpl-b", 2, include_usage=True, continuous=True, prompt=9)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "temperature": 0, "stream_options": {"continuous_usage_stats": True}}
    res = send(rig, Plan(CHAT, [Leg(first, cut, "fin", has), Leg(rest)]), body)
    assert res.raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in res.raw
    assert res.bodies[1]["stream_options"] == {"continuous_usage_stats": True,
                                               "include_usage": True}
    with_usage = [e for e in res.raw.split(b"\n\n") if b'"usage"' in e]
    assert with_usage == [], with_usage  # vLLM straight would send no usage at all
