"""Mid-stream continuation on the wire (issue 17): every cut point, the exact client bytes.

Two scripted vLLM backends of ``m1`` (``tests/support/scripted.py``; three where a
continuation is cut again) behind the real gateway under uvicorn; a raw HTTP client (httpx,
no SDK) reads the exact bytes. Whichever backend the router picks first streams a chat (or
completions) answer as vLLM 0.32 does (the shapes of ``gateway/sim/protocol.py`` and
``sim/streaming.py``: both asked with ``return_token_ids``, so each chunk carries its
``token_ids`` and the first the ``prompt_token_ids``, which the client, who did not ask, sees
as ``null``, as vLLM would send it) and breaks at a cut point: between
events, after a token whose text vLLM held back (a UTF-8 sequence split over tokens:
``""``), inside an event, inside a UTF-8 sequence (and inside one whose first token was held
back), after the last content before ``finish_reason``, after ``finish_reason`` before
``[DONE]`` (and after the usage chunk). The break is a FIN in the middle of the chunked
body, the body's clean end without ``[DONE]``, a TCP RST, or silence past
``proxy.idle_timeout_s``. The other backend answers the continuation (or breaks too, and a
third one answers).

Each test asserts the exact bytes the client received (one ``id``, the first backend's
``created`` and ``model``, no duplicated or missing text, one ``finish_reason``, one usage
with the prompt tokens once, even where the chat continuation's re-tokenized prompt counts
otherwise, and the completion tokens summed, ``data: [DONE]``) and the exact
continuation request the second backend received. The expectations are built here from the
token list (what an uninterrupted vLLM stream would carry), not by the code under test; two
of them are also written out byte for byte. A stream that cannot continue (``n`` > 1, a
tool call cut in the middle, ``x-gateway-continuation: off``) ends with today's error event
and ``[DONE]``, and the second backend receives nothing.

The backends and their breaks are ``tests/support/broken_streams.py``'s: a backend breaks
only once the client has read every complete event before the cut (so a RST cannot discard
bytes the gateway had not read yet). The silent backend has its own gateway with a short
``proxy.idle_timeout_s``; the others keep the default, so a break that comes late on a slow
machine is never taken for silence.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.broken_streams import (
    Break,
    Leg,
    Plan,
    Rig,
    events_within,
    make_rig,
    send,
    stop_rig,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "m1"
IDLE_S = 0.3  # proxy.idle_timeout_s where a backend falls silent (the "hang" break)


@dataclass(frozen=True)
class Ident:
    """What identifies one backend's stream."""

    id: str
    created: int
    fp: str


A = {CHAT: Ident("chatcmpl-first", 1_700_000_001, "fp_first"),
     COMPLETIONS: Ident("cmpl-first", 1_700_000_001, "fp_first")}
B = {CHAT: Ident("chatcmpl-second", 1_700_000_002, "fp_second"),
     COMPLETIONS: Ident("cmpl-second", 1_700_000_002, "fp_second")}

# The generation: (text, token id). The third token ends inside the UTF-8 sequence of "ß"
# (vLLM's detokenizer sends "" for it; its text comes with the fourth). Then EOS (id 2, "",
# finish_reason "stop"): 6 completion tokens in all.
TOKENS = [("Hello", 11), (" wörld", 12), ("", 13), ("ß!", 14), (" end", 15)]
EOS_ID = 2
COMPLETION_TOKENS = len(TOKENS) + 1
PROMPT_IDS = [101, 102, 103]  # the completions prompt "Say hi", as the backend tokenized it
CHAT_PROMPT_TOKENS = 9  # the chat request's prompt, as the backend counted it
CHAT_PROMPT_IDS = list(range(201, 201 + CHAT_PROMPT_TOKENS))  # its ids (return_token_ids)
# The chat continuation's prompt re-renders the text and re-tokenizes it, which may count
# otherwise than the generated tokens: here 2 more. The client's usage still says the
# original prompt's count (from the first stream's prompt_token_ids).
RETOKENIZED = 2


def enc(obj: Any) -> bytes:
    """One SSE event as vLLM writes it: compact JSON, UTF-8 unescaped, LF framing."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


# ---- vLLM 0.32's streams, built from the token list ----------------------------------------


def chat_events(ident: Ident, first: int, *, include_usage: bool, prompt_tokens: int,
                role: bool = True, prompt_ids: list[int] | None = None,
                ids: bool = False) -> list[bytes]:
    """A chat stream from token ``first`` on: the role chunk (with ``prompt_ids``, else null),
    one chunk per token (its ``token_ids`` when ``ids``: ``return_token_ids``, else null), the
    EOS chunk with ``finish_reason`` (with the fingerprint when no usage is asked), the usage
    chunk when asked, ``[DONE]``."""
    head = {"id": ident.id, "object": "chat.completion.chunk", "created": ident.created,
            "model": MODEL}
    out = []
    if role:
        out.append(enc({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                        "prompt_token_ids": prompt_ids, "prompt_text": None}))
    for text, tid in TOKENS[first:]:
        out.append(enc({**head, "choices": [{"index": 0, "delta": {"content": text},
                                             "logprobs": None, "finish_reason": None,
                                             "token_ids": [tid] if ids else None}]}))
    last: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"content": ""},
                                                 "logprobs": None, "finish_reason": "stop",
                                                 "stop_reason": None,
                                                 "token_ids": [EOS_ID] if ids else None}]}
    if not include_usage:
        last["system_fingerprint"] = ident.fp
    out.append(enc(last))
    if include_usage:
        out.append(enc({**head, "choices": [],
                        "usage": usage(prompt_tokens, COMPLETION_TOKENS - first),
                        "system_fingerprint": ident.fp}))
    return [*out, DONE]


def completion_events(ident: Ident, first: int, *, include_usage: bool,
                      prompt_ids: list[int] | None, ids: bool = True) -> list[bytes]:
    """A completions stream from token ``first`` on: the prompt's ids in the first chunk
    (``prompt_ids``; None: null there too), each chunk's ids (``ids``: ``return_token_ids``;
    else null), the EOS chunk, the usage chunk when asked, ``[DONE]``."""
    head = {"id": ident.id, "object": "text_completion", "created": ident.created,
            "model": MODEL}

    def chunk(i: int, text: str, tid: int, finish: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish, "stop_reason": None,
                                     "prompt_token_ids": prompt_ids if i == first else None,
                                     "token_ids": [tid] if ids else None}]}

    out = [enc(chunk(i, text, tid, None)) for i, (text, tid) in enumerate(TOKENS) if i >= first]
    last = chunk(len(TOKENS), "", EOS_ID, "stop")
    if not include_usage:
        last["system_fingerprint"] = ident.fp
    out.append(enc(last))
    if include_usage:
        p = len(prompt_ids) if prompt_ids is not None else len(PROMPT_IDS)
        out.append(enc({**head, "choices": [], "usage": usage(p, COMPLETION_TOKENS - first),
                        "system_fingerprint": ident.fp}))
    return [*out, DONE]


def original(endpoint: str, include_usage: bool) -> list[bytes]:
    """The first backend's whole stream (what an uninterrupted one sends when asked for the
    token ids, as the gateway asks)."""
    if endpoint == CHAT:
        return chat_events(A[CHAT], 0, include_usage=include_usage,
                           prompt_tokens=CHAT_PROMPT_TOKENS, prompt_ids=CHAT_PROMPT_IDS,
                           ids=True)
    return completion_events(A[COMPLETIONS], 0, include_usage=include_usage,
                             prompt_ids=PROMPT_IDS)


def client_view(endpoint: str, include_usage: bool) -> list[bytes]:
    """The same stream as vLLM sends a client that did not ask for token ids (null where the
    ids were): what the client of the gateway must see of the first stream."""
    if endpoint == CHAT:
        return chat_events(A[CHAT], 0, include_usage=include_usage,
                           prompt_tokens=CHAT_PROMPT_TOKENS)
    return completion_events(A[COMPLETIONS], 0, include_usage=include_usage,
                             prompt_ids=None, ids=False)


def client_prefix(endpoint: str, include_usage: bool, offset: int) -> bytes:
    """What the client has of the first stream broken at byte ``offset``: its complete
    events before it, as the client sees them."""
    k = len(events_within(original(endpoint, include_usage), offset))
    return b"".join(client_view(endpoint, include_usage)[:k])


def continuation(endpoint: str, settled: int) -> list[bytes]:
    """The second backend's answer to a continuation after ``settled`` tokens, as vLLM sends
    it for that request (always with usage: the gateway asks for it; its prompt is the
    original plus the ``settled`` tokens)."""
    if endpoint == CHAT:
        prompt = CHAT_PROMPT_TOKENS + settled + RETOKENIZED
        return chat_events(B[CHAT], settled, include_usage=True, prompt_tokens=prompt,
                           prompt_ids=list(range(301, 301 + prompt)), ids=True)
    return completion_events(B[COMPLETIONS], settled, include_usage=True,
                             prompt_ids=PROMPT_IDS + [t for _, t in TOKENS[:settled]])


def client_rest(endpoint: str, include_usage: bool, sent: int) -> bytes:
    """What the client must get after the ``sent`` token events it already had: the rest of
    the generation in the first stream's ``id`` / ``created`` (no second role chunk, no
    prompt ids, the held-back token not twice), the EOS chunk without a fingerprint (the
    continuation was asked with usage), the usage chunk if the client asked (prompt tokens
    once, completion tokens the sum; the continuation's fingerprint), ``[DONE]``."""
    ident = Ident(A[endpoint].id, A[endpoint].created, B[endpoint].fp)
    if endpoint == CHAT:
        events = chat_events(ident, sent, include_usage=True, prompt_tokens=0, role=False)
        prompt = CHAT_PROMPT_TOKENS
    else:
        events = completion_events(ident, sent, include_usage=True, prompt_ids=None,
                                   ids=False)
        prompt = len(PROMPT_IDS)
    body, usage_event = events[:-2], events[-2]
    if not include_usage:
        return b"".join(body) + DONE
    obj = json.loads(usage_event[6:])
    assert obj["choices"] == []
    obj["usage"] = usage(prompt, COMPLETION_TOKENS)
    return b"".join(body) + enc(obj) + DONE


# ---- requests ------------------------------------------------------------------------------

CHAT_BODY: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "stream": True,
    "temperature": 0, "seed": 7, "top_p": 0.9, "stop_token_ids": [99], "x_unknown": {"keep": [1]},
}
COMPLETIONS_BODY: dict[str, Any] = {
    "model": MODEL, "prompt": "Say hi", "stream": True, "temperature": 0, "seed": 7,
    "top_p": 0.9, "stop_token_ids": [99], "frequency_penalty": 0.5, "x_unknown": {"keep": [1]},
}
LIMIT = 50  # the client's token limit


def client_body(endpoint: str, include_usage: bool) -> dict[str, Any]:
    """The client's request: chat with ``max_tokens`` (no usage) or ``max_completion_tokens``
    (usage asked), completions with ``max_tokens``."""
    if endpoint == CHAT:
        limit = "max_completion_tokens" if include_usage else "max_tokens"
        body = {**CHAT_BODY, limit: LIMIT}
    else:
        body = {**COMPLETIONS_BODY, "max_tokens": LIMIT}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def continuation_request(endpoint: str, include_usage: bool, settled: int) -> dict[str, Any]:
    """The exact JSON the second backend must receive after ``settled`` tokens."""
    body = client_body(endpoint, include_usage)
    text = "".join(t for t, _ in TOKENS[:settled])
    if endpoint == CHAT:
        limit = "max_completion_tokens" if include_usage else "max_tokens"
        return {**body, "return_token_ids": True,
                "messages": [*CHAT_BODY["messages"], {"role": "assistant", "content": text}],
                "continue_final_message": True, "add_generation_prompt": False,
                limit: LIMIT - settled, "stream_options": {"include_usage": True}}
    return {**body, "return_token_ids": True,
            "prompt": PROMPT_IDS + [t for _, t in TOKENS[:settled]],
            "max_tokens": LIMIT - settled, "stream_options": {"include_usage": True}}


# ---- the rigs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    """The module's gateway (the default idle timeout: no break is mistaken for silence,
    however slow the machine)."""
    r = make_rig(None)
    yield r
    stop_rig(r)


@pytest.fixture(scope="module")
def idle_rig() -> Iterator[Rig]:
    """A gateway with a short ``proxy.idle_timeout_s``, for the silent backend."""
    r = make_rig(IDLE_S)
    yield r
    stop_rig(r)


# ---- cut points ----------------------------------------------------------------------------


def token_event(endpoint: str, i: int) -> int:
    """Index of the event that carries token ``i`` (``len(TOKENS)``: the EOS chunk)."""
    return i + 1 if endpoint == CHAT else i


def at_event(events: list[bytes], k: int) -> int:
    """Byte offset of event ``k``'s start."""
    return sum(len(e) for e in events[:k])


def inside(events: list[bytes], k: int, needle: bytes, into: int) -> int:
    """Byte offset ``into`` bytes into ``needle`` inside event ``k``."""
    return at_event(events, k) + events[k].index(needle) + into


# name -> (offset in the first stream, token events the client has, tokens settled)
# (settled: up to the last event with text; a held-back token is generated again)
def cut_points(endpoint: str, include_usage: bool) -> dict[str, tuple[int, int, int]]:
    ev = original(endpoint, include_usage)
    fin = token_event(endpoint, len(TOKENS))
    cuts = {
        "between_events": (at_event(ev, token_event(endpoint, 2)), 2, 2),
        "after_held_back_token": (at_event(ev, token_event(endpoint, 3)), 3, 2),
        "inside_event": (inside(ev, token_event(endpoint, 4), b'"logprobs"', 4), 4, 4),
        "inside_utf8": (inside(ev, token_event(endpoint, 1), "ö".encode(), 1), 1, 1),
        "inside_utf8_after_held_back": (
            inside(ev, token_event(endpoint, 3), "ß".encode(), 1), 3, 2),
        "after_last_content": (at_event(ev, fin), 5, 5),
        "after_finish_reason": (at_event(ev, fin + 1), 6, 6),
    }
    if include_usage:
        cuts["after_usage"] = (at_event(ev, fin + 2), 6, 6)
    return cuts


ENDPOINTS = {"chat": CHAT, "completions": COMPLETIONS}
USAGE = {"usage": True, "no_usage": False}
CASES = [(e, u, c) for e in ENDPOINTS for u in USAGE
         for c in cut_points(ENDPOINTS[e], USAGE[u])]
CLOSING = ("after_finish_reason", "after_usage")  # the generation is over: nothing to ask

# the break -> the stream error the gateway sees
BREAKS = {"fin": "upstream_disconnected", "end": "upstream_incomplete",
          "rst": "upstream_disconnected", "hang": "upstream_idle_timeout"}


def expected_client(endpoint: str, include_usage: bool, cut: str) -> bytes:
    """The exact bytes the client must get (module docstring)."""
    offset, sent, _ = cut_points(endpoint, include_usage)[cut]
    prefix = client_prefix(endpoint, include_usage, offset)
    if cut not in CLOSING:
        return prefix + client_rest(endpoint, include_usage, sent)
    owed = b""
    if cut == "after_finish_reason" and include_usage:
        # the usage chunk the gateway owes: the prompt's ids were streamed, the produced
        # tokens are the ids sent; no fingerprint (the stream had sent none)
        ident = A[endpoint]
        prompt = CHAT_PROMPT_TOKENS if endpoint == CHAT else len(PROMPT_IDS)
        obj = "chat.completion.chunk" if endpoint == CHAT else "text_completion"
        owed = enc({"id": ident.id, "object": obj, "created": ident.created,
                    "model": MODEL, "choices": [],
                    "usage": usage(prompt, COMPLETION_TOKENS)})
    return prefix + owed + DONE


def cut_leg(events: list[bytes], offset: int, brk: Break, client_has: int) -> Leg:
    """``events`` broken (``brk``) at byte ``offset``, once the client has ``client_has``
    bytes (every complete event before the cut, as the client sees them)."""
    return Leg(events, offset, brk, client_has)


def one_cut(endpoint: str, include_usage: bool, cut: str, brk: Break) -> Plan:
    """The first backend's stream broken at ``cut``; the continuation answered whole."""
    offset, _, settled = cut_points(endpoint, include_usage)[cut]
    has = len(client_prefix(endpoint, include_usage, offset))
    return Plan(endpoint, [cut_leg(original(endpoint, include_usage), offset, brk, has),
                           Leg(continuation(endpoint, settled))])


def first_request(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the first backend gets for the client's ``body`` (continuation on): asked for
    the token ids."""
    return {**body, "return_token_ids": True}


def run_cut(rig: Rig, endpoint: str, include_usage: bool, cut: str, brk: Break) -> None:
    body = client_body(endpoint, include_usage)
    res = send(rig, one_cut(endpoint, include_usage, cut, brk), body)
    assert res.raw == expected_client(endpoint, include_usage, cut)
    if cut in CLOSING:  # closed by the gateway itself: nobody else asked
        assert res.bodies == [first_request(endpoint, body)]
        assert res.continuations == {(BREAKS[brk], "closed"): 1}
    else:
        settled = cut_points(endpoint, include_usage)[cut][2]
        assert res.bodies == [first_request(endpoint, body),
                              continuation_request(endpoint, include_usage, settled)]
        assert res.backends[0] != res.backends[1]
        assert res.continuations == {(BREAKS[brk], "continued"): 1}


@pytest.mark.parametrize(("endpoint", "use", "cut"), CASES)
def test_cut_point_continues_with_exact_bytes(rig, endpoint, use, cut):
    """At every cut point of a chat and a completions stream (with and without the usage
    chunk), a connection that dies mid-body: the client's bytes are the uninterrupted
    generation's, the second backend got the exact continuation request (or nothing when
    the generation was over)."""
    run_cut(rig, ENDPOINTS[endpoint], USAGE[use], cut, "fin")


BREAK_CUTS = ("between_events", "inside_utf8_after_held_back", "after_finish_reason")


@pytest.mark.parametrize("brk", ["end", "rst", "hang"])
@pytest.mark.parametrize("cut", BREAK_CUTS)
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_each_kind_of_break_continues_with_exact_bytes(request, endpoint, cut, brk):
    """The other kinds of break, at a cut between events, one inside an event (inside a UTF-8
    sequence whose first token was held back) and one after ``finish_reason``: the body's
    clean end without ``[DONE]``, a TCP RST, the backend's silence past the idle timeout."""
    rig = request.getfixturevalue("idle_rig" if brk == "hang" else "rig")
    run_cut(rig, ENDPOINTS[endpoint], True, cut, brk)


@pytest.fixture(scope="module")
def rig3() -> Iterator[Rig]:
    """Three backends: room for a second continuation."""
    r = make_rig(None, n=3)
    yield r
    stop_rig(r)


@pytest.mark.parametrize("use", list(USAGE))
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_continuation_cut_again_continues_on_a_third_backend(rig3, endpoint, use):
    """The first stream is cut inside the "ö" (1 token sent, FIN), its continuation inside
    the "ß" after the held-back token (3 sent, 2 settled; RST): the third backend is asked
    from what the client saw of both (the second's events as the client got them), and the
    client's bytes are the uninterrupted generation's."""
    path, include_usage = ENDPOINTS[endpoint], USAGE[use]
    first = original(path, include_usage)
    second = continuation(path, 1)
    # the client's bytes before the second break: the uninterrupted stream's up to token 3
    client_has = at_event(client_view(path, include_usage), token_event(path, 3))
    cut1 = inside(first, token_event(path, 1), "ö".encode(), 1)
    plan = Plan(path, [
        cut_leg(first, cut1, "fin", len(client_prefix(path, include_usage, cut1))),
        cut_leg(second, inside(second, token_event(path, 3 - 1), "ß".encode(), 1), "rst",
                client_has),
        Leg(continuation(path, 2)),
    ])
    body = client_body(path, include_usage)
    res = send(rig3, plan, body)
    assert res.raw == expected_client(path, include_usage, "inside_utf8")
    assert res.bodies == [first_request(path, body),
                          continuation_request(path, include_usage, 1),
                          continuation_request(path, include_usage, 2)]
    assert sorted(res.backends) == [0, 1, 2]
    assert res.continuations == {("upstream_disconnected", "continued"): 2}


# ---- two expectations written out byte for byte -------------------------------------------


def test_chat_cut_inside_utf8_written_out(rig):
    """Chat with usage, cut inside the "ö" of the second token's event: the client's bytes,
    spelled out."""
    res = send(rig, one_cut(CHAT, True, "inside_utf8", "rst"), client_body(CHAT, True))
    head = b'"id":"chatcmpl-first","object":"chat.completion.chunk","created":1700000001,' \
           b'"model":"m1"'
    assert res.raw == (
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
        b'\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":"Hello"},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":" w\xc3\xb6rld"},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":""},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":"\xc3\x9f!"},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":" end"},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[{"index":0,"delta":{"content":""},'
        b'"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + head + b',"choices":[],"usage":{"prompt_tokens":9,"total_tokens":15,'
        b'"completion_tokens":6},"system_fingerprint":"fp_second"}\n\n'
        b'data: [DONE]\n\n'
    )
    assert res.bodies[1:] == [{
        "model": "m1", "stream": True, "temperature": 0, "seed": 7, "top_p": 0.9,
        "stop_token_ids": [99], "x_unknown": {"keep": [1]}, "max_completion_tokens": 49,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Say hi"},
                     {"role": "assistant", "content": "Hello"}],
        "continue_final_message": True, "add_generation_prompt": False,
        "return_token_ids": True,
    }]


def test_completions_cut_inside_event_written_out(rig):
    """Completions without usage, cut inside the fifth token's event: the client's bytes,
    spelled out (the token ids the gateway asked for null, as vLLM sends them to a client
    that did not ask; the rest as the continuation's with the first stream's id and
    created)."""
    res = send(rig, one_cut(COMPLETIONS, False, "inside_event", "fin"),
               client_body(COMPLETIONS, False))
    head = b'"id":"cmpl-first","object":"text_completion","created":1700000001,"model":"m1"'
    tail = (b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
            b'"token_ids":null}]}\n\n')
    assert res.raw == (
        b'data: {' + head + b',"choices":[{"index":0,"text":"Hello",' + tail +
        b'data: {' + head + b',"choices":[{"index":0,"text":" w\xc3\xb6rld",' + tail +
        b'data: {' + head + b',"choices":[{"index":0,"text":"",' + tail +
        b'data: {' + head + b',"choices":[{"index":0,"text":"\xc3\x9f!",' + tail +
        b'data: {' + head + b',"choices":[{"index":0,"text":" end",' + tail +
        b'data: {' + head + b',"choices":[{"index":0,"text":"","logprobs":null,'
        b'"finish_reason":"stop","stop_reason":null,"prompt_token_ids":null,'
        b'"token_ids":null}]}\n\n'
        b'data: [DONE]\n\n'
    )
    assert res.bodies[1:] == [{
        "model": "m1", "prompt": [101, 102, 103, 11, 12, 13, 14], "stream": True,
        "temperature": 0, "seed": 7, "top_p": 0.9, "stop_token_ids": [99],
        "frequency_penalty": 0.5, "x_unknown": {"keep": [1]}, "max_tokens": 46,
        "return_token_ids": True, "stream_options": {"include_usage": True},
    }]


# ---- streams that cannot continue ----------------------------------------------------------

ERROR_DISCONNECTED = (
    b'data: {"error":{"message":"The backend connection broke mid-stream '
    b'(ClientPayloadError); the answer is incomplete.","type":"server_error","param":null,'
    b'"code":"upstream_disconnected"}}\n\n'
)


def n2_chat() -> list[bytes]:
    """A chat stream of ``n`` = 2, as vLLM interleaves it."""
    ident = A[CHAT]
    head = {"id": ident.id, "object": "chat.completion.chunk", "created": ident.created,
            "model": MODEL}
    out = [enc({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": None, "prompt_text": None}) for i in (0, 1)]
    for text in ("Hello", " there"):
        for i in (0, 1):
            out.append(enc({**head, "choices": [{"index": i, "delta": {"content": text},
                                                 "logprobs": None, "finish_reason": None,
                                                 "token_ids": None}]}))
    return [*out, DONE]


def n2_completions(ids: bool = True) -> list[bytes]:
    """A completions stream of ``n`` = 2 (``ids``: with the token ids; else null, as the
    client sees it)."""
    ident = A[COMPLETIONS]
    head = {"id": ident.id, "object": "text_completion", "created": ident.created,
            "model": MODEL}
    out = []
    for k, (text, tid) in enumerate(TOKENS[:2]):
        for i in (0, 1):
            out.append(enc({**head, "choices": [{
                "index": i, "text": text, "logprobs": None, "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": PROMPT_IDS if k == 0 and ids else None,
                "token_ids": [tid] if ids else None}]}))
    return [*out, DONE]


def tool_call_chat() -> list[bytes]:
    """A chat stream whose answer is a tool call (vLLM's hermes parser's deltas)."""
    ident = A[CHAT]
    head = {"id": ident.id, "object": "chat.completion.chunk", "created": ident.created,
            "model": MODEL}

    def delta(d: dict[str, Any]) -> bytes:
        return enc({**head, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                         "finish_reason": None, "token_ids": None}]})

    call = {"index": 0, "id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}
    return [
        enc({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}],
             "prompt_token_ids": None, "prompt_text": None}),
        delta({"tool_calls": [call]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}),
        DONE,
    ]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]

# name -> (endpoint, the first stream, as the client sees it, how many events before the
#          cut, body, headers, the continuation metric's outcome, or None: no continuer at
#          all, so no token ids asked for: the backend sends nulls)
NOT_CONTINUED: dict[str, tuple[str, list[bytes], list[bytes], int, dict[str, Any],
                               dict[str, str], str | None]] = {
    "chat_n2": (CHAT, n2_chat(), n2_chat(), 4, {**client_body(CHAT, False), "n": 2}, {},
                "n_gt_1"),
    "completions_n2": (COMPLETIONS, n2_completions(), n2_completions(False), 3,
                       {**client_body(COMPLETIONS, False), "n": 2}, {}, "n_gt_1"),
    "chat_tool_call_cut": (CHAT, tool_call_chat(), tool_call_chat(), 3,
                           {**client_body(CHAT, False), "tools": TOOLS, "tool_choice": "auto"},
                           {}, "tool_call"),
    "chat_stop_strings": (CHAT, original(CHAT, False), client_view(CHAT, False), 3,
                          {**client_body(CHAT, False), "stop": ["\n\n"]}, {}, "stop"),
    "completions_echo": (COMPLETIONS, client_view(COMPLETIONS, False),
                         client_view(COMPLETIONS, False), 2,
                         {**client_body(COMPLETIONS, False), "echo": True}, {}, "echo"),
    "chat_header_off": (CHAT, client_view(CHAT, True), client_view(CHAT, True), 3,
                        client_body(CHAT, True), {"x-gateway-continuation": "off"}, None),
    "completions_header_off": (COMPLETIONS, client_view(COMPLETIONS, True),
                               client_view(COMPLETIONS, True), 2,
                               client_body(COMPLETIONS, True),
                               {"x-gateway-continuation": "OFF"}, None),
}


@pytest.mark.parametrize("case", list(NOT_CONTINUED))
def test_stream_that_cannot_continue_ends_with_the_error_event(rig, case):
    """``n`` > 1, a tool call cut in its arguments, ``stop`` strings, ``echo``,
    ``x-gateway-continuation: off``: the
    client gets the events before the cut, then today's error event and ``[DONE]``, exactly;
    the second backend receives nothing; the first got the client's request (completions:
    with ``return_token_ids`` unless the client turned continuation off)."""
    endpoint, events, view, k, body, headers, outcome = NOT_CONTINUED[case]
    offset = at_event(events, k) + 10  # inside event k
    prefix = b"".join(view[:k])
    res = send(rig, Plan(endpoint, [Leg(events, offset, "fin", len(prefix))]), body, headers)
    assert res.raw == prefix + ERROR_DISCONNECTED + DONE
    asked = outcome is not None and not body.get("echo")  # echo: sent without the ids
    assert res.bodies == [first_request(endpoint, body) if asked else body]
    assert res.continuations == (
        {} if outcome is None else {("upstream_disconnected", outcome): 1})
