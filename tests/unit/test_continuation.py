"""Mid-stream continuation, byte level (issue 17): for each cut point, the original stream's
bytes are cut, what a relay forwards (only complete events: ``EventFramer``) is recorded,
the continuation body built, a scripted continuation backend's bytes stitched, and the
client's bytes compared exactly with what an uninterrupted backend would have sent.

The streams are built with the simulator's vLLM 0.32 chunk shapes (``gateway.sim.protocol``,
compared field by field with a real vLLM), token ids added as vLLM streams them with
``return_token_ids: true`` (per choice ``token_ids``; the prompt's in the first chunk).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.proxy.continuation import (
    CHAT,
    COMPLETIONS,
    StreamTranscript,
    continuable,
    continuation_body,
    partial_tail,
    seam_drops,
    seam_ids,
    with_token_ids,
)
from gateway.proxy.sse import EventFramer
from gateway.proxy.stitch import Stitcher, closing_events
from gateway.sim import protocol as P

MODEL = "m"
FP = "fp_a"
PROMPT_IDS = [101, 102, 103, 104, 105]
# tokens as (text, id): a "ß" split over two tokens (the first one's text held back)
TOKENS = [("Hello", 1), (" wörld", 2), ("", 3), ("ß!", 4), (" ok", 5), (" end", 6)]


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + P.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_events(
    rid: str, created: int, tokens: list[tuple[str, int]], *, prompt_tokens: int,
    produced_before: int = 0, usage: bool = True, finish: str = "stop", fp: str = FP,
    role: bool = True,
) -> list[bytes]:
    """A chat stream as the simulator (vLLM) sends it: role chunk, one chunk per token, the
    EOS chunk with ``finish`` (one more token), usage chunk, [DONE]."""
    out = [ev(P.chat_role_chunk(rid, created, MODEL, 0))] if role else []
    for text, _ in tokens:
        out.append(ev(P.chat_delta_chunk(rid, created, MODEL, 0, text, None)))
    last = P.chat_delta_chunk(rid, created, MODEL, 0, "", finish)
    if not usage:
        last["system_fingerprint"] = fp
    out.append(ev(last))
    if usage:
        n = len(tokens) + 1
        out.append(ev(P.usage_chunk(rid, created, MODEL, "chat.completion.chunk",
                                    prompt_tokens, n, fp)))
    return [*out, DONE]


def completion_events(
    rid: str, created: int, tokens: list[tuple[str, int]], *, prompt_ids: list[int],
    usage: bool = True, eos: int = 0,
) -> list[bytes]:
    """A completions stream with ``return_token_ids``: the prompt's ids in the first chunk,
    each chunk's ids, the EOS chunk (``stop``), usage, [DONE]."""
    out = []
    for i, (text, tid) in enumerate(tokens):
        c = P.completion_chunk(rid, created, MODEL, 0, text, None)
        c["choices"][0]["token_ids"] = [tid]
        if i == 0:
            c["choices"][0]["prompt_token_ids"] = prompt_ids
        out.append(ev(c))
    last = P.completion_chunk(rid, created, MODEL, 0, "", "stop")
    last["choices"][0]["token_ids"] = [eos]
    if not tokens:
        last["choices"][0]["prompt_token_ids"] = prompt_ids
    out.append(ev(last))
    if usage:
        out.append(ev(P.usage_chunk(rid, created, MODEL, "text_completion",
                                    len(prompt_ids), len(tokens) + 1, FP)))
    return [*out, DONE]


def relay(stream: bytes, cut: int) -> bytes:
    """What the client received of ``stream`` cut at byte ``cut``: complete events only."""
    return EventFramer().feed(stream[:cut])


def stitch(endpoint: str, request: dict[str, Any], t: StreamTranscript,
           cont: list[bytes], chunking: int = 7) -> bytes:
    """The continuation's bytes, arriving in ``chunking``-byte pieces, framed and stitched."""
    framer, st = EventFramer(), Stitcher(endpoint, request, t)
    raw = b"".join(cont)
    out = b""
    for i in range(0, len(raw), chunking):
        out += st.feed(framer.feed(raw[i : i + chunking]))
    out += st.feed(framer.finish())
    assert st.done
    return out


def text_of(stream: bytes, chat: bool) -> str:
    parts = []
    for e in stream.split(b"\n\n"):
        if not e.startswith(b"data: {"):
            continue
        for ch in json.loads(e[6:])["choices"]:
            parts.append((ch["delta"].get("content") if chat else ch["text"]) or "")
    return "".join(parts)


CHAT_REQ: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
    "stream_options": {"include_usage": True}, "max_tokens": 50, "temperature": 0,
    "seed": 7, "x_unknown": {"a": 1},
}
COMP_REQ: dict[str, Any] = {
    "model": MODEL, "prompt": "hi there", "stream": True, "return_token_ids": True,
    "stream_options": {"include_usage": True}, "max_tokens": 50, "temperature": 0,
    "seed": 7, "stop_token_ids": [99], "x_unknown": True,
}


def boundaries(events: list[bytes]) -> list[int]:
    out, at = [], 0
    for e in events:
        at += len(e)
        out.append(at)
    return out


# ---- chat: every cut point -----------------------------------------------------------------


def _chat_case(cut: int, *, expect_sent_tokens: int) -> None:
    original = chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9)
    whole = b"".join(original)
    sent = relay(whole, cut)
    t = StreamTranscript(CHAT)
    t.feed(sent)
    k = expect_sent_tokens
    assert t.text() == "".join(x for x, _ in TOKENS[:k])
    assert continuable(CHAT, CHAT_REQ, t).ok
    body = continuation_body(CHAT, CHAT_REQ, t)
    assert not k or TOKENS[k - 1][0]  # the cut leaves no held-back token at the end
    produced = k  # token events up to the last with text
    if t.text():
        assert body["messages"] == [*CHAT_REQ["messages"],
                                    {"role": "assistant", "content": t.text()}]
        assert body["continue_final_message"] is True
        assert body["add_generation_prompt"] is False
    else:
        assert body["messages"] == CHAT_REQ["messages"]
    assert body["max_tokens"] == 50 - produced
    # the continuation backend: its own id, created, role chunk; prompt = original + text
    cont = chat_events("chatcmpl-b", 2000, TOKENS[k:], prompt_tokens=9 + produced)
    # its usage counts its own tokens; the stitched one must be the whole generation's
    client = sent + stitch(CHAT, CHAT_REQ, t, cont)
    assert client == b"".join(original)
    assert text_of(client, chat=True) == "".join(x for x, _ in TOKENS)


def test_chat_cut_between_events_continues_to_the_exact_uninterrupted_bytes() -> None:
    ends = boundaries(chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9))
    _chat_case(ends[2], expect_sent_tokens=2)  # role + 2 tokens reached the client


def test_chat_cut_inside_an_event_is_generated_again() -> None:
    ends = boundaries(chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9))
    _chat_case(ends[2] + 20, expect_sent_tokens=2)  # the half event never reached the client


def test_chat_cut_inside_a_utf8_sequence() -> None:
    events = chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9)
    whole = b"".join(events)
    cut = whole.index("ö".encode()) + 1  # between the two bytes of "ö"
    assert whole[cut - 1] >= 0xC0
    with pytest.raises(UnicodeDecodeError):
        whole[:cut].decode()
    _chat_case(cut, expect_sent_tokens=1)


def test_chat_cut_after_the_last_content_before_finish_reason() -> None:
    ends = boundaries(chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9))
    _chat_case(ends[len(TOKENS)], expect_sent_tokens=len(TOKENS))


def test_chat_cut_after_a_token_whose_text_was_held_back() -> None:
    """vLLM sent an empty delta for the first half of "ß": that token is not counted as
    sent; the continuation makes it again and its empty event is not sent twice."""
    original = chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9)
    ends = boundaries(original)
    sent = relay(b"".join(original), ends[3])  # role, "Hello", " wörld", ""
    t = StreamTranscript(CHAT)
    t.feed(sent)
    assert t.produced() == (2, "events")
    with_usage = StreamTranscript(CHAT)  # continuous_usage_stats counts the held token too
    for i, e in enumerate(original[:4]):
        c = json.loads(e[6:])
        c["usage"] = P.usage(9, i, full=False)
        with_usage.feed(ev(c))
    assert with_usage.produced() == (2, "usage")
    body = continuation_body(CHAT, CHAT_REQ, t)
    assert body["max_tokens"] == 48
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello wörld"}
    cont = chat_events("chatcmpl-b", 2000, TOKENS[2:], prompt_tokens=11)
    assert sent + stitch(CHAT, CHAT_REQ, t, cont) == b"".join(original)


def test_chat_cut_after_the_role_chunk_resends_the_original_request() -> None:
    ends = boundaries(chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9))
    _chat_case(ends[0], expect_sent_tokens=0)


def test_chat_cut_after_finish_reason_before_done_closes_the_stream() -> None:
    original = chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9)
    ends = boundaries(original)
    finish_end = ends[len(TOKENS) + 1]
    t = StreamTranscript(CHAT)
    t.feed(relay(b"".join(original), finish_end))
    verdict = continuable(CHAT, CHAT_REQ, t)
    assert verdict.reason == "finished" and verdict.closes
    # prompt tokens were never said (no ids, no usage yet): no usage can be made up
    assert closing_events(CHAT, CHAT_REQ, t, verdict) == DONE
    # with vLLM's ids the usage is known and sent before [DONE], as vLLM would have
    t2 = StreamTranscript(CHAT)
    first = json.loads(original[0][6:])
    first["prompt_token_ids"] = list(range(9))
    t2.feed(ev(first))
    for i, e in enumerate(original[1 : len(TOKENS) + 2]):
        c = json.loads(e[6:])
        c["choices"][0]["token_ids"] = [TOKENS[i][1] if i < len(TOKENS) else 0]
        t2.feed(ev(c))
    assert closing_events(CHAT, CHAT_REQ, t2, continuable(CHAT, CHAT_REQ, t2)) == (
        original[len(TOKENS) + 2].replace(b',"system_fingerprint":"fp_a"', b"") + DONE
    )


# ---- completions: every cut point (token-id continuation) ----------------------------------


def _completion_case(cut: int, *, sent_events: int, settled: int) -> None:
    original = completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS)
    sent = relay(b"".join(original), cut)
    assert sent == b"".join(original[:sent_events])
    t = StreamTranscript(COMPLETIONS)
    t.feed(sent)
    assert continuable(COMPLETIONS, COMP_REQ, t).ok
    body = continuation_body(COMPLETIONS, COMP_REQ, t)
    ids = [tid for _, tid in TOKENS[:settled]]
    assert body["prompt"] == (PROMPT_IDS + ids if settled else COMP_REQ["prompt"])
    assert body["max_tokens"] == 50 - settled
    cont = completion_events("cmpl-b", 2000, TOKENS[settled:], prompt_ids=PROMPT_IDS + ids)
    client = sent + stitch(COMPLETIONS, COMP_REQ, t, cont, chunking=5)
    assert client == b"".join(original)
    assert text_of(client, chat=False) == "".join(x for x, _ in TOKENS)


def test_completions_cut_between_events() -> None:
    ends = boundaries(completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS))
    _completion_case(ends[1], sent_events=2, settled=2)


def test_completions_cut_inside_an_event() -> None:
    ends = boundaries(completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS))
    _completion_case(ends[1] + 30, sent_events=2, settled=2)


def test_completions_cut_inside_a_utf8_sequence_at_byte_and_token_level() -> None:
    events = completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS)
    whole = b"".join(events)
    cut = whole.index("ß".encode()) + 1  # inside the bytes of "ß", inside event 3
    assert whole[cut - 1] >= 0xC0
    # events 0..2 reached the client; event 2 is the token whose text was held back, so
    # its id is generated again by the continuation, not put in its prompt
    _completion_case(cut, sent_events=3, settled=2)


def test_completions_cut_after_the_last_content_before_finish_reason() -> None:
    ends = boundaries(completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS))
    _completion_case(ends[len(TOKENS) - 1], sent_events=len(TOKENS), settled=len(TOKENS))


def test_completions_cut_after_finish_reason_before_done_sends_usage_and_done() -> None:
    original = completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS)
    ends = boundaries(original)
    t = StreamTranscript(COMPLETIONS)
    sent = relay(b"".join(original), ends[len(TOKENS)])
    t.feed(sent)
    verdict = continuable(COMPLETIONS, COMP_REQ, t)
    assert verdict.reason == "finished"
    # the usage chunk vLLM would have sent (its fingerprint was never seen: not made up)
    tail = closing_events(COMPLETIONS, COMP_REQ, t, verdict)
    assert tail == original[-2].replace(b',"system_fingerprint":"fp_a"', b"") + DONE
    # the usage chunk sent, then the cut: only [DONE] is owed
    t.feed(original[-2])
    assert closing_events(COMPLETIONS, COMP_REQ, t, continuable(COMPLETIONS, COMP_REQ, t)) == DONE


def test_completions_without_token_ids_are_not_continued_once_text_was_sent() -> None:
    events = [e.replace(b'"token_ids":[1]', b'"token_ids":null') for e in
              completion_events("cmpl-a", 1000, TOKENS[:1], prompt_ids=PROMPT_IDS)]
    t = StreamTranscript(COMPLETIONS)
    t.feed(events[0].replace(b'"prompt_token_ids":[101,102,103,104,105]',
                             b'"prompt_token_ids":null'))
    assert t.text() == "Hello"
    assert continuable(COMPLETIONS, COMP_REQ, t).reason == "no_token_ids"
    # nothing sent yet but the first chunk: the original request again is exact
    assert continuable(COMPLETIONS, COMP_REQ, StreamTranscript(COMPLETIONS)).ok


def test_two_continuations_sum_usage_over_three_attempts() -> None:
    original = completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS)
    t = StreamTranscript(COMPLETIONS)
    client = b"".join(original[:2])
    t.feed(client)
    ids2 = [1, 2]
    cont1 = completion_events("cmpl-b", 2000, TOKENS[2:], prompt_ids=PROMPT_IDS + ids2)
    st = Stitcher(COMPLETIONS, COMP_REQ, t)
    part = st.feed(b"".join(cont1[:2]))  # the second backend dies after two events
    client += part
    t.feed(part)
    assert continuable(COMPLETIONS, COMP_REQ, t, used=1).ok
    assert continuable(COMPLETIONS, COMP_REQ, t, used=2).reason == "budget"
    body = continuation_body(COMPLETIONS, COMP_REQ, t)
    assert body["prompt"] == [*PROMPT_IDS, 1, 2, 3, 4] and body["max_tokens"] == 46
    cont2 = completion_events("cmpl-c", 3000, TOKENS[4:], prompt_ids=body["prompt"])
    client += stitch(COMPLETIONS, COMP_REQ, t, cont2)
    assert client == b"".join(original)


# ---- the stitcher's own rules --------------------------------------------------------------


def test_usage_is_dropped_when_the_client_did_not_ask_and_the_fingerprint_kept() -> None:
    req = {**CHAT_REQ, "stream_options": None}
    original = chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9, usage=False)
    t = StreamTranscript(CHAT)
    sent = b"".join(original[:3])
    t.feed(sent)
    body = continuation_body(CHAT, req, t)
    assert body["stream_options"] == {"include_usage": True}
    cont = chat_events("chatcmpl-b", 2000, TOKENS[2:], prompt_tokens=11)  # usage asked
    # the usage chunk (which carries vLLM's fingerprint when usage is asked) is dropped, so
    # the finish chunk comes without the fingerprint an uninterrupted stream puts there
    expected = b"".join(original).replace(b',"system_fingerprint":"fp_a"', b"")
    assert sent + stitch(CHAT, req, t, cont) == expected


def test_a_fingerprint_the_client_saw_wins_over_the_continuations() -> None:
    t = StreamTranscript(CHAT)
    role = P.chat_role_chunk("chatcmpl-a", 1000, MODEL, 0)
    role["system_fingerprint"] = "fp_first"
    t.feed(ev(role))
    cont = chat_events("chatcmpl-b", 2000, TOKENS[:1], prompt_tokens=3, usage=False, fp="fp_b")
    out = stitch(CHAT, {**CHAT_REQ, "stream_options": None}, t, cont)
    assert b"fp_b" not in out and out.count(b'"system_fingerprint":"fp_first"') == 1
    assert out.count(b"chatcmpl-a") == 2 and b"chatcmpl-b" not in out


def test_one_finish_reason_one_done_and_continuous_usage_rewritten() -> None:
    t = StreamTranscript(CHAT)
    t.feed(ev(P.chat_role_chunk("chatcmpl-a", 1000, MODEL, 0))
           + ev(P.chat_delta_chunk("chatcmpl-a", 1000, MODEL, 0, "a", None)))
    st = Stitcher(CHAT, CHAT_REQ, t)
    c = P.chat_delta_chunk("chatcmpl-b", 2000, MODEL, 0, "b", None)
    c["usage"] = P.usage(5, 1, full=False)  # continuous_usage_stats: prompt 4 + 1 produced
    out = st.feed(ev(c))
    assert json.loads(out[6:])["usage"] == P.usage(4, 2, full=False)
    f = ev(P.chat_delta_chunk("chatcmpl-b", 2000, MODEL, 0, "", "stop"))
    out = st.feed(f + DONE)
    # the continuation sent no usage chunk: one is made from the counts before [DONE]
    assert out.endswith(
        b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":1000,"model":"m",'
        b'"choices":[],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3}}\n\n'
        + DONE)
    st = Stitcher(CHAT, {**CHAT_REQ, "stream_options": None}, t)
    out = st.feed(f + f + DONE + DONE)
    assert out.count(b'"finish_reason":"stop"') == 1 and out.count(DONE) == 1
    first = f.replace(b"chatcmpl-b", b"chatcmpl-a").replace(b":2000,", b":1000,")
    second = first.replace(b'"finish_reason":"stop"', b'"finish_reason":null')
    assert out == first + second + DONE


def test_comments_errors_and_garbage_pass_through_unchanged() -> None:
    t = StreamTranscript(CHAT)
    st = Stitcher(CHAT, CHAT_REQ, t)
    block = b": ping\n\n" + b"data: not json\n\n" + P.dumps({"error": {"code": 500}}).join(
        [b"data: ".decode(), "\n\n"]).encode()
    assert st.feed(block) == block


def test_budget_spent_closes_with_finish_reason_length() -> None:
    req = {**COMP_REQ, "max_tokens": 2}
    events = completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS)
    t = StreamTranscript(COMPLETIONS)
    t.feed(b"".join(events[:2]))
    verdict = continuable(COMPLETIONS, req, t)
    assert verdict.reason == "length" and verdict.closes
    head = '{"id":"cmpl-a","object":"text_completion","created":1000,"model":"m",'
    assert closing_events(COMPLETIONS, req, t, verdict) == (
        f'data: {head}"choices":[{{"index":0,"text":"","logprobs":null,'
        '"finish_reason":"length"}]}\n\n'
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":5,"total_tokens":7,'
        '"completion_tokens":2}}\n\n'
        "data: [DONE]\n\n"
    ).encode()


# ---- the request side ----------------------------------------------------------------------


def _chat_transcript(*deltas: dict[str, Any], finish: str | None = None) -> StreamTranscript:
    t = StreamTranscript(CHAT)
    t.feed(ev(P.chat_role_chunk("c", 1, MODEL, 0)))
    for d in deltas:
        c = P.chat_delta_chunk("c", 1, MODEL, 0, "", finish)
        c["choices"][0]["delta"] = d
        t.feed(ev(c))
    return t


@pytest.mark.parametrize(
    ("request_extra", "deltas", "reason"),
    [
        ({"n": 2}, [{"content": "x"}], "n_gt_1"),
        ({}, [{"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]}], "tool_call"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, [{"content": "x"}],
         "tool_call"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, [{"content": "{"}],
         "structured_output"),
        ({"response_format": {"type": "json_object"}}, [{"content": "{"}], "structured_output"),
        ({"guided_regex": "a+"}, [{"content": "a"}], "structured_output"),
        ({"structured_outputs": {"choice": ["a"]}}, [{"content": "a"}], "structured_output"),
        ({"logprobs": True}, [{"content": "x"}], "logprobs"),
        ({}, [{"reasoning_content": "hmm"}], "reasoning"),
        ({}, [{"reasoning": "hmm"}], "reasoning"),
        ({}, [{"refusal": "no"}], "refusal"),
    ],
)
def test_what_cannot_be_exact_is_not_continued(
    request_extra: dict[str, Any], deltas: list[dict[str, Any]], reason: str
) -> None:
    verdict = continuable(CHAT, {**CHAT_REQ, **request_extra}, _chat_transcript(*deltas))
    assert verdict.reason == reason and not verdict.ok and not verdict.closes


def test_stream_facts_that_rule_out_exactness() -> None:
    t = StreamTranscript(CHAT)
    two = P.chat_delta_chunk("c", 1, MODEL, 1, "x", None)
    t.feed(ev(P.chat_delta_chunk("c", 1, MODEL, 0, "x", None)) + ev(two))
    assert continuable(CHAT, CHAT_REQ, t).reason == "n_gt_1"
    t = StreamTranscript(CHAT)
    lp = P.chat_delta_chunk("c", 1, MODEL, 0, "x", None)
    lp["choices"][0]["logprobs"] = {"content": []}
    t.feed(ev(lp))
    assert continuable(CHAT, CHAT_REQ, t).reason == "logprobs"
    t = StreamTranscript(CHAT)
    t.feed(b"data: {broken\n\n")
    assert continuable(CHAT, CHAT_REQ, t).reason == "unparseable"
    t = StreamTranscript(CHAT)
    t.feed(b'data: {"error":{"message":"boom","type":"x","param":null,"code":500}}\n\n')
    assert continuable(CHAT, CHAT_REQ, t).reason == "error"
    assert continuable(COMPLETIONS, {**COMP_REQ, "prompt": ["a", "b"]},
                       StreamTranscript(COMPLETIONS)).reason == "n_gt_1"
    assert continuable(COMPLETIONS, {**COMP_REQ, "logprobs": 0},
                       StreamTranscript(COMPLETIONS)).reason == "logprobs"
    assert continuable("/v1/responses", {}, StreamTranscript("/v1/responses")).reason == "endpoint"
    odd = {**CHAT_REQ, "n": "2", "best_of": None, "messages": "x", "stream_options": [1]}
    assert continuable(CHAT, odd, _chat_transcript({"content": "x"})).ok  # never raises
    assert continuation_body(CHAT, odd, _chat_transcript({"content": "x"}))["messages"] == [
        {"role": "assistant", "content": "x"}]


def test_constrained_output_is_continued_while_nothing_was_generated() -> None:
    req = {**CHAT_REQ, "response_format": {"type": "json_object"}}
    assert continuable(CHAT, req, _chat_transcript()).ok


def test_the_header_turns_it_off_case_insensitively() -> None:
    t = _chat_transcript({"content": "x"})
    assert continuable(CHAT, CHAT_REQ, t, headers={"X-Gateway-Continuation": "OFF"}).reason == (
        "disabled")
    assert continuable(CHAT, CHAT_REQ, t, headers=[("x-gateway-continuation", "off")]).reason == (
        "disabled")
    assert continuable(CHAT, CHAT_REQ, t, headers={"x-gateway-continuation": "on"}).ok
    assert continuable(CHAT, CHAT_REQ, t, used=2, max_continuations=2).reason == "budget"
    assert continuable(CHAT, CHAT_REQ, t, used=0, max_continuations=0).reason == "budget"


def test_budget_reduction_and_unknown_fields_pass_through() -> None:
    t = _chat_transcript({"content": "ab"}, {"content": "c"})
    req = {**CHAT_REQ, "max_completion_tokens": 30, "min_tokens": 5, "top_p": 0.5,
           "stop": ["x"], "user": "u", "stream_options": {"include_usage": False,
                                                          "continuous_usage_stats": True}}
    body = continuation_body(CHAT, req, t)
    assert body == {
        **req,
        "messages": [*req["messages"], {"role": "assistant", "content": "abc"}],
        "max_completion_tokens": 28, "max_tokens": 48, "min_tokens": 3,
        "continue_final_message": True, "add_generation_prompt": False, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert req["messages"] == CHAT_REQ["messages"]  # the client's request is not changed
    # completions: the default max_tokens (16) is reduced; the ids say the count
    t = StreamTranscript(COMPLETIONS)
    t.feed(b"".join(completion_events("cmpl-a", 1, TOKENS, prompt_ids=[9])[:4]))
    req = {k: v for k, v in COMP_REQ.items() if k != "max_tokens"} | {"echo": True}
    body = continuation_body(COMPLETIONS, req, t)
    assert body["max_tokens"] == 16 - 4 and body["echo"] is False
    assert body["prompt"] == [9, 1, 2, 3, 4] and body["x_unknown"] is True
    assert body["stop_token_ids"] == [99] and body["seed"] == 7
    assert body["return_token_ids"] is True
    # chat without a limit stays without one
    nolimit = {k: v for k, v in CHAT_REQ.items() if k != "max_tokens"}
    assert "max_tokens" not in continuation_body(CHAT, nolimit, _chat_transcript({"content": "x"}))


def test_a_client_prefill_is_extended_not_duplicated() -> None:
    req = {**CHAT_REQ, "continue_final_message": True, "add_generation_prompt": False,
           "messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "Sure: "}]}
    body = continuation_body(CHAT, req, _chat_transcript({"content": "one"}))
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert len(body["messages"]) == 2


def test_with_token_ids_asks_the_first_backend_for_ids() -> None:
    assert with_token_ids(COMPLETIONS, {"prompt": "x"}) == {"prompt": "x", "return_token_ids": True}
    assert with_token_ids("/v1/embeddings", {"input": "x"}) == {"input": "x"}


# ---- every byte offset ---------------------------------------------------------------------


def _scripted_backend(endpoint: str, body: dict[str, Any]) -> list[bytes]:
    """A backend that generates TOKENS deterministically (temperature 0) from wherever the
    continuation body's prefix leaves off: the ids it was given, or the shortest run of
    tokens whose text is the assistant prefix."""
    if endpoint == COMPLETIONS:
        prompt = body["prompt"]
        k = len(prompt) - len(PROMPT_IDS) if isinstance(prompt, list) else 0
        assert not isinstance(prompt, list) or prompt == PROMPT_IDS + [i for _, i in TOKENS[:k]]
        return completion_events("cmpl-z", 5000, TOKENS[k:], prompt_ids=PROMPT_IDS
                                 + [i for _, i in TOKENS[:k]])
    prefix = body["messages"][-1]["content"] if body.get("continue_final_message") else ""
    k = next(k for k in range(len(TOKENS) + 1) if "".join(x for x, _ in TOKENS[:k]) == prefix)
    assert body["max_tokens"] == CHAT_REQ["max_tokens"] - k
    return chat_events("chatcmpl-z", 5000, TOKENS[k:], prompt_tokens=9 + k)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_every_cut_offset_gives_the_uninterrupted_stream(endpoint: str) -> None:
    """Cut at every byte after the first event: a continuation, or the owed tail once the
    finish was sent. The client's text is always the uninterrupted text, with one
    finish_reason and one [DONE]; while the generation was not finished, the client's bytes
    are exactly the uninterrupted stream's."""
    chat = endpoint == CHAT
    req = CHAT_REQ if chat else COMP_REQ
    original = (chat_events("chatcmpl-a", 1000, TOKENS, prompt_tokens=9) if chat
                else completion_events("cmpl-a", 1000, TOKENS, prompt_ids=PROMPT_IDS))
    whole = b"".join(original)
    finish_end = boundaries(original)[-3]  # the finish chunk's end
    for cut in range(boundaries(original)[0], len(whole)):
        sent = relay(whole, cut)
        t = StreamTranscript(endpoint)
        t.feed(sent)
        verdict = continuable(endpoint, req, t)
        if cut < finish_end:
            assert verdict.ok, (cut, verdict)
            cont = _scripted_backend(endpoint, continuation_body(endpoint, req, t))
            client = sent + stitch(endpoint, req, t, cont, chunking=3 + cut % 11)
            assert client == whole, cut
        else:
            assert verdict.reason == "finished", (cut, verdict)
            client = sent + closing_events(endpoint, req, t, verdict)
            assert text_of(client, chat) == "".join(x for x, _ in TOKENS)
            assert client.count(b'"finish_reason":"stop"') == 1
            assert client.count(DONE) == 1 and client.endswith(DONE)


def test_hide_token_ids_gives_back_vllms_nulls() -> None:
    """:func:`hide_token_ids` turns ``token_ids`` / ``prompt_token_ids`` lists (compact or
    spaced) into ``null``, as vLLM sends them when not asked, and changes nothing else: not
    text that spells them, not a null already there."""
    from gateway.proxy.continuation import hide_token_ids

    compact = (b'data: {"id":"c","choices":[{"index":0,"text":"a,\\"token_ids\\":[1]",'
               b'"finish_reason":null,"token_ids":[12,13]}],"prompt_token_ids":[1,2,3]}\n\n')
    assert hide_token_ids(compact) == (
        b'data: {"id":"c","choices":[{"index":0,"text":"a,\\"token_ids\\":[1]",'
        b'"finish_reason":null,"token_ids":null}],"prompt_token_ids":null}\n\n')
    spaced = (b'data: {"prompt_token_ids": [1, 2], "id": "x", "choices": '
              b'[{"token_ids": null, "text": "hi"}]}\n\ndata: [DONE]\n\n')
    assert hide_token_ids(spaced) == (
        b'data: {"prompt_token_ids": null, "id": "x", "choices": '
        b'[{"token_ids": null, "text": "hi"}]}\n\ndata: [DONE]\n\n')
    plain = b'data: {"id":"c","choices":[{"text":"token_ids"}]}\n\n'
    assert hide_token_ids(plain) is plain
    chat = (b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}'
            b'}],"prompt_token_ids":[5,6],"prompt_text":"<|im_start|>user\\n\\"hi\\"'
            b'<|im_end|>"}\n\n')
    assert hide_token_ids(chat) == (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}'
        b'}],"prompt_token_ids":null,"prompt_text":null}\n\n')


def test_a_completions_continuation_that_leaks_its_prompt_is_cut_after_it() -> None:
    """vLLM 0.32 (vllm-project/vllm#48853) streams a token-id prompt's whole text back in the
    first delta when the prompt ends inside a UTF-8 sequence: the client must get only the
    new text. A first delta that does not hold the client's text passes unchanged, and only
    the first text is checked."""
    from gateway.proxy.stitch import Stitcher, leaked_prefix

    sent = "al\ufffdal\ufffdal\ufffdal"
    assert leaked_prefix("violin winter" + sent + "\u00e9x", sent, "violin winter") == (
        13 + len(sent))
    assert leaked_prefix("violin winter" + sent + "\u00e9x", sent, None) == 13 + len(sent)
    assert leaked_prefix("ab" + "c\u00e9", "ab", "P") == 0  # short: needs the prompt
    assert leaked_prefix("Pab" + "c\u00e9", "ab", "P") == 3
    assert leaked_prefix("\u00e9 more", sent, "violin") == 0
    # repetitive text the new text goes on: cut after its first place, not one period later
    loop = "al\ufffd" * 7 + "al"
    assert leaked_prefix("P x" + loop + "\ufffdal\ufffd", loop, None) == 3 + len(loop)

    req = {"model": "m", "prompt": "violin winter", "stream": True}
    t = StreamTranscript(COMPLETIONS)
    t.feed(b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":'
           b'[{"index":0,"text":"' + sent.encode() + b'","logprobs":null,'
           b'"finish_reason":null,"token_ids":[7,8,9,10,11,12,13,14,15,16]}]}\n\n')
    st = Stitcher(COMPLETIONS, req, t)
    leak = ("violin winter" + sent + "\u00e9").encode()
    out = st.feed(b'data: {"id":"c2","object":"text_completion","created":2,"model":"m",'
                  b'"choices":[{"index":0,"text":"' + leak + b'","logprobs":null,'
                  b'"finish_reason":null,"token_ids":[17]}]}\n\n'
                  b'data: {"id":"c2","object":"text_completion","created":2,"model":"m",'
                  b'"choices":[{"index":0,"text":"' + leak + b'","logprobs":null,'
                  b'"finish_reason":null,"token_ids":[18]}]}\n\n')
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in out.split(b"\n\n") if e]
    assert texts == ["\u00e9", leak.decode()]  # the first cut, the second as sent


def test_stop_strings_and_echo_are_not_continued() -> None:
    """``stop`` strings once text was generated (vLLM holds back text that may begin one
    while streaming every id, and checks one only in its own output): ``stop``; ``echo``
    (the echoed prompt is not generated text): ``echo``, and its first attempt is sent
    without ``return_token_ids`` (vLLM 0.32 blanks the echo with it). Stop token ids, an
    empty stop string and stop strings before any text are no obstacle."""
    t = StreamTranscript(COMPLETIONS)
    t.feed(b"".join(completion_events("cmpl-a", 1, TOKENS, prompt_ids=[9])[:2]))
    assert continuable(COMPLETIONS, {**COMP_REQ, "stop": ["END"]}, t).reason == "stop"
    assert continuable(COMPLETIONS, {**COMP_REQ, "stop": "\n"}, t).reason == "stop"
    assert continuable(COMPLETIONS, {**COMP_REQ, "stop": ["", None]}, t).ok
    assert continuable(COMPLETIONS, {**COMP_REQ, "echo": True}, t).reason == "echo"
    assert continuable(CHAT, {**CHAT_REQ, "stop": ["x"]},
                       _chat_transcript({"content": "ab"})).reason == "stop"
    assert continuable(CHAT, {**CHAT_REQ, "stop": ["x"]}, _chat_transcript()).ok
    echo = {k: v for k, v in COMP_REQ.items() if k != "return_token_ids"} | {"echo": True}
    assert "return_token_ids" not in with_token_ids(COMPLETIONS, echo)


def _multi_id_transcript(events: list[tuple[str, list[int]]]) -> StreamTranscript:
    """A completions transcript of events that carry several ids each."""
    t = StreamTranscript(COMPLETIONS)
    for text, ids in events:
        t.feed(ev({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": None, "token_ids": ids}]}))
    return t


def test_the_seam_is_checked_only_after_an_event_of_several_ids() -> None:
    """``seam_ids``: the last text event's ids (and up to 4 before them) when it carried more
    than one; at most 3 may be held back, never all of the event's; ``unsettle`` moves the
    count, the continuation's prompt and budget with it."""
    one = _multi_id_transcript([("a", [1]), ("b", [2])])
    assert seam_ids(one) is None and seam_drops(one) == 0
    t = _multi_id_transcript([("a", [1, 2, 3, 4, 5, 6]), ("b", [7, 8, 9]), ("", [10])])
    assert seam_ids(t) == [3, 4, 5, 6, 7, 8, 9]  # token 10 came without text: not settled
    assert seam_drops(t) == 2
    t.unsettle(5)  # bounded by the event's ids but one
    assert t.produced() == (7, "token_ids")
    body = continuation_body(COMPLETIONS, {"model": MODEL, "prompt": [100], "max_tokens": 20,
                                           "stream": True}, t)
    assert body["prompt"] == [100, 1, 2, 3, 4, 5, 6, 7]
    assert body["max_tokens"] == 13
    assert partial_tail("ab\ufffd") and not partial_tail("a\ufffdb") and not partial_tail("")
