"""Mid-stream continuation with ``stop`` strings (issue 17), as real vLLM streams them.

Found while trying the feature (r17b-try). vLLM's detokenizer holds back the last
``max(len(s) for s in stop) - 1`` characters of the text while a request with ``stop``
strings runs (``stop_buffer_length`` in ``vllm/v1/engine/detokenizer.py``
``BaseIncrementalDetokenizer.get_next_output_text``; ``include_stop_str_in_output`` false,
the default), so that a stop string is never half-sent; the chunk's ``token_ids`` still
carry every generated id. So the text the client has lags the ids the gateway records, and:

* a completions continuation from the prompt's ids plus every id sent loses the held-back
  characters: the next backend never generates them again (``test_held_back_characters_...``);
* a stop string that straddles the cut is never seen: the next backend's detokenizer checks
  only its own output, so the generation runs past where it had to stop
  (``test_a_stop_string_straddling_the_cut_...``).

The scripted backends below stream exactly what vLLM would (:func:`vllm_completions`, the
detokenizer's hold-back and stop check written out), the first one cut after a chosen
event, the second answering the continuation request for the prompt the gateway sends
(prompt ids + every generated id). Either the client gets the uninterrupted text (one
``finish_reason``, the right one), or the gateway says it cannot be exact (the error event):
never silently other text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.broken_streams import Leg, Plan, Rig, make_rig, send, stop_rig

COMPLETIONS = "/v1/completions"
MODEL = "m1"
PROMPT_IDS = [101, 102, 103]
EOS_ID = 2


def enc(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def vllm_completions(ident: str, tokens: list[tuple[str, int]], stop: list[str],
                     prompt_ids: list[int], *, ids: bool, usage_prompt: int | None = None,
                     ) -> list[bytes]:
    """vLLM's completions stream of ``tokens`` (then EOS) for a request with ``stop``: per
    token the detokenizer's delta with ``max(len(stop)) - 1`` characters held back, the
    stop check on the request's own output text (truncated before the stop string, finish
    ``stop`` with its ``stop_reason``), EOS ends with the rest of the text."""
    buf = max(len(s) for s in stop) - 1 if stop else 0
    head = {"id": ident, "object": "text_completion", "created": 1_700_000_001, "model": MODEL}
    out_text, sent, events, n = "", 0, [], 0

    def chunk(text: str, tid: int, finish: str | None, reason: str | None) -> bytes:
        return enc({**head, "choices": [{
            "index": 0, "text": text, "logprobs": None, "finish_reason": finish,
            "stop_reason": reason, "prompt_token_ids": prompt_ids if ids and not events else None,
            "token_ids": [tid] if ids else None}]})

    finish, reason = "stop", None
    for text, tid in tokens:
        n += 1
        out_text += text
        hit = next((s for s in stop if s in out_text[max(0, sent - len(s)):]), None)
        if hit is not None:
            out_text = out_text[:out_text.index(hit)]
            events.append(chunk(out_text[sent:], tid, "stop", hit))
            sent = len(out_text)
            break
        length = len(out_text) - buf
        delta = out_text[sent:length] if length > sent else ""
        sent = max(sent, length)
        events.append(chunk(delta, tid, None, None))
    else:
        n += 1
        events.append(chunk(out_text[sent:], EOS_ID, finish, reason))
    if usage_prompt is not None:
        events.append(enc({**head, "choices": [], "usage": {
            "prompt_tokens": usage_prompt, "total_tokens": usage_prompt + n,
            "completion_tokens": n}}))
    return [*events, b"data: [DONE]\n\n"]


def client_text(raw: bytes) -> tuple[str, list[str], bool]:
    """The text, finish reasons and whether an error event came, from the client's bytes."""
    text, finishes, error = "", [], False
    for e in raw.split(b"\n\n"):
        if not e.startswith(b"data: {"):
            continue
        obj = json.loads(e[6:])
        if "error" in obj:
            error = True
            continue
        for ch in obj["choices"]:
            text += ch.get("text") or ""
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    return text, finishes, error


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = make_rig(None)
    yield r
    stop_rig(r)


def run(rig: Rig, tokens: list[tuple[str, int]], stop: list[str], cut_after: int
        ) -> tuple[str, list[str], bool, list[dict[str, Any]]]:
    """The first backend streams ``tokens`` and breaks after the event of token
    ``cut_after`` (1-based); the second answers the continuation as vLLM would for the
    prompt ids + the ids the gateway recorded (the first ``cut_after``)."""
    first = vllm_completions("cmpl-a", tokens, stop, PROMPT_IDS, ids=True)
    seen = vllm_completions("cmpl-a", tokens, stop, PROMPT_IDS, ids=False)
    cut = sum(map(len, first[:cut_after]))
    has = sum(map(len, seen[:cut_after]))
    rest = vllm_completions("cmpl-b", tokens[cut_after:], stop,
                            PROMPT_IDS + [t for _, t in tokens[:cut_after]], ids=True,
                            usage_prompt=len(PROMPT_IDS) + cut_after)
    body = {"model": MODEL, "prompt": "Say hi", "stream": True, "temperature": 0,
            "max_tokens": 50, "stop": stop}
    res = send(rig, Plan(COMPLETIONS, [Leg(first, cut, "fin", has), Leg(rest)]), body)
    text, finishes, error = client_text(res.raw)
    return text, finishes, error, res.bodies


def whole(tokens: list[tuple[str, int]], stop: list[str]) -> tuple[str, list[str]]:
    """The uninterrupted stream's text and finish reasons (the same emulation)."""
    raw = b"".join(vllm_completions("cmpl-a", tokens, stop, PROMPT_IDS, ids=False))
    text, finishes, _ = client_text(raw)
    return text, finishes


def test_held_back_characters_are_not_lost_at_the_cut(rig: Rig) -> None:
    """``stop: ["\\n\\n"]`` (vLLM holds back 1 character): cut after the second token's
    event, the client has "Hello worl" (the "d" held back) while the ids say "Hello world".
    Uninterrupted: "Hello world again and"."""
    tokens = [("Hello", 11), (" world", 12), (" again", 13), (" and", 14)]
    stop = ["\n\n"]
    want_text, want_finish = whole(tokens, stop)
    assert want_text == "Hello world again and"
    text, finishes, error, _ = run(rig, tokens, stop, 2)
    if not error:  # continued: it must be exact
        assert (text, finishes) == (want_text, want_finish)


def test_a_stop_string_straddling_the_cut_still_stops(rig: Rig) -> None:
    """``stop: ["END"]`` (2 characters held back): "Go E" | "ND ..." — uninterrupted, vLLM
    stops at "END" (text "Go ", finish ``stop``); cut after " E", the continuation's
    detokenizer never sees "END"."""
    tokens = [("Go", 11), (" E", 12), ("ND", 13), (" more", 14), (" text", 15)]
    stop = ["END"]
    want_text, want_finish = whole(tokens, stop)
    assert (want_text, want_finish) == ("Go ", ["stop"])
    text, finishes, error, _ = run(rig, tokens, stop, 2)
    if not error:
        assert (text, finishes) == (want_text, want_finish)
