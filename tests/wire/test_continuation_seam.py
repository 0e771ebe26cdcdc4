"""Mid-stream continuation at a seam inside a character (issue 17): an event that carried
text *and*, after it, a token that ends inside a UTF-8 sequence.

vLLM sends several tokens in one event (``--stream-interval`` > 1, or when its output lags);
its detokenizer sends no text for a token that ends inside a character. So an event can
carry ``" w"`` with the ids of ``" w"`` and of the first byte of ``"ß"``: the client has the
text of one id, not both. Which one the text covers needs the tokenizer: before the
continuation, the gateway asks a backend of the model (``POST /detokenize``) and holds the
partial id back. Measured without it on real vLLM 0.32 (``benchmarks/real_vllm.py
continuation``): the completions continuation's prompt ended inside the character and vLLM
streamed the whole prompt's text back (vllm-project/vllm#48853), and the produced count
(the continuation's ``max_tokens``, the client's usage) was one token too many.

Two scripted vLLM backends (``tests/support/broken_streams.py``, which answers
``/detokenize`` from a byte vocabulary as a Hugging Face tokenizer decodes) behind the real
gateway under uvicorn; a raw HTTP client reads the bytes. The expectations are built here
from the vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.broken_streams import Leg, Plan, Rig, make_rig, send, stop_rig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "m1"
LIMIT = 40
PROMPT_IDS = [101, 102, 103]
EOS = 2
# id -> bytes; 13 is the first byte of "ß" (U+00DF: C3 9F), 14 the rest and "!"
VOCAB = {11: b"Hello", 12: b" w", 13: b"\xc3", 14: b"\x9f!", 15: b" end", EOS: b"",
         **{i: b"p" for i in PROMPT_IDS}}
# The first backend's events: (text, ids). The second carries " w" and the partial 13.
FIRST = [("Hello", [11]), (" w", [12, 13])]
# The continuation from [11, 12]: 13 and 14 together ("ß!"), then " end", then EOS.
REST = [("ß!", [13, 14]), (" end", [15])]
TEXT = "Hello wß! end"
COMPLETION_TOKENS = 6  # 11, 12, 13, 14, 15 and EOS


def enc(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def events(endpoint: str, ident: str, tokens: list[tuple[str, list[int]]], prompt: list[int],
           final: bool) -> list[bytes]:
    """A vLLM 0.32 stream asked with ``return_token_ids``: the tokens' events, and when
    ``final`` the EOS chunk, the usage chunk (asked by the gateway) and ``[DONE]``."""
    head = {"id": ident, "object": "chat.completion.chunk" if endpoint == CHAT
            else "text_completion", "created": 1_700_000_000, "model": MODEL}

    def choice(text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        if endpoint == CHAT:
            return {"index": 0, "delta": {"content": text}, "logprobs": None,
                    "finish_reason": finish, "token_ids": ids}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                "stop_reason": None, "token_ids": ids}

    out = []
    if endpoint == CHAT:
        out.append(enc({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}],
                        "prompt_token_ids": prompt, "prompt_text": None}))
    for i, (text, ids) in enumerate(tokens):
        c = choice(text, ids, None)
        if endpoint == COMPLETIONS and i == 0:
            c["prompt_token_ids"] = prompt
        out.append(enc({**head, "choices": [c]}))
    if final:
        produced = sum(len(ids) for _, ids in tokens) + 1
        out.append(enc({**head, "choices": [choice("", [EOS], "stop")]}))
        out.append(enc({**head, "choices": [], "usage": {
            "prompt_tokens": len(prompt), "total_tokens": len(prompt) + produced,
            "completion_tokens": produced}}))
        out.append(b"data: [DONE]\n\n")
    return out


def body(endpoint: str) -> dict[str, Any]:
    if endpoint == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "temperature": 0, "max_tokens": LIMIT, "stream_options": {"include_usage": True}}
    return {"model": MODEL, "prompt": "ppp", "stream": True, "temperature": 0,
            "max_tokens": LIMIT, "stream_options": {"include_usage": True}}


def plan(endpoint: str, vocab: dict[int, bytes] | None) -> Plan:
    """The first backend sends ``FIRST`` then its connection closes; the second answers the
    continuation from 2 settled ids."""
    first = events(endpoint, "first", FIRST, PROMPT_IDS, final=False)
    second_prompt = [*PROMPT_IDS, 11, 12] if endpoint == COMPLETIONS else list(range(300, 307))
    second = events(endpoint, "second", REST, second_prompt, final=True)
    sent = b"".join(first)
    return Plan(endpoint, [Leg(first, cut=len(sent), brk="fin", client_has=0), Leg(second)],
                vocab=vocab)


def client_stream(raw: bytes) -> tuple[str, list[str | None], list[dict[str, Any]], bool]:
    """The client's text, finish reasons, usage objects, and whether it ended ``[DONE]``."""
    text, finishes, usages = "", [], []
    chunks = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    for data in chunks:
        if data == b"[DONE]":
            continue
        obj = json.loads(data)
        assert "error" not in obj, obj
        for ch in obj["choices"]:
            text += (ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
            finishes.append(ch["finish_reason"])
            assert ch.get("token_ids") is None  # the client did not ask for ids
        if obj.get("usage"):
            usages.append(obj["usage"])
    return text, [f for f in finishes if f is not None], usages, chunks[-1:] == [b"[DONE]"]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = make_rig(None)
    yield r
    stop_rig(r)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_an_id_that_ends_inside_a_character_is_held_back_and_generated_again(rig, endpoint):
    """The partial id is held back: the completions continuation's prompt ends on "w" (not
    inside "ß"), both endpoints' budgets and usage count the 2 tokens whose text the client
    has, the client's text is the whole generation once, one finish, one usage, ``[DONE]``.
    The gateway asked ``/detokenize`` twice: the event's ids (ending in U+FFFD), then
    without the last."""
    res = send(rig, plan(endpoint, VOCAB), body(endpoint))
    text, finishes, usages, done = client_stream(res.raw)
    assert (text, finishes, done) == (TEXT, ["stop"], True)
    prompt_tokens = len(PROMPT_IDS)
    assert usages == [{"prompt_tokens": prompt_tokens, "completion_tokens": COMPLETION_TOKENS,
                       "total_tokens": prompt_tokens + COMPLETION_TOKENS}]
    cont = res.bodies[1]
    assert cont["max_tokens"] == LIMIT - 2
    if endpoint == COMPLETIONS:
        assert cont["prompt"] == [*PROMPT_IDS, 11, 12]
    else:
        assert cont["messages"][-1] == {"role": "assistant", "content": "Hello w"}
    assert res.detokenized == [[11, 12, 13], [11, 12]]
    assert res.continuations == {("upstream_disconnected", "continued"): 1}


def test_a_backend_without_detokenize_leaves_the_ids_as_they_were(rig):
    """A backend that does not serve ``/detokenize`` (404): the continuation goes on from
    every id the events carried, as before the check (the text may then be wrong by vLLM's
    prompt leak, which the stitcher cuts when it can; the stream still ends whole)."""
    res = send(rig, plan(COMPLETIONS, None), body(COMPLETIONS))
    cont = res.bodies[1]
    assert cont["prompt"] == [*PROMPT_IDS, 11, 12, 13]
    assert cont["max_tokens"] == LIMIT - 3
    assert res.detokenized == [[11, 12, 13]]
    _, finishes, _, done = client_stream(res.raw)
    assert (finishes, done) == (["stop"], True)


def test_an_event_of_several_whole_tokens_holds_nothing_back(rig):
    """The event's ids end on a whole character (" w" then "ß" whole in one id): one
    ``/detokenize``, nothing held back."""
    vocab = {**VOCAB, 13: "ß".encode(), 14: b"!"}
    p = plan(COMPLETIONS, vocab)
    p.legs[1] = Leg(events(COMPLETIONS, "second", [("!", [14]), (" end", [15])],
                           [*PROMPT_IDS, 11, 12, 13], final=True))
    first = events(COMPLETIONS, "first", [("Hello", [11]), (" wß", [12, 13])], PROMPT_IDS,
                   final=False)
    p.legs[0] = Leg(first, cut=len(b"".join(first)), brk="fin")
    res = send(rig, p, body(COMPLETIONS))
    assert res.bodies[1]["prompt"] == [*PROMPT_IDS, 11, 12, 13]
    assert res.detokenized == [[11, 12, 13]]
    text, _, usages, _ = client_stream(res.raw)
    assert text == "Hello wß! end"
    assert usages[0]["completion_tokens"] == COMPLETION_TOKENS
