"""The SSE framer: complete events only, LF framing, byte-exact payloads, usage lookup,
in-band errors and terminal events."""

from __future__ import annotations

import json

from gateway.proxy.sse import DONE_EVENT, EventFramer, error_event, extract_usage, has_event


def feed_all(chunks: list[bytes]) -> tuple[bytes, EventFramer]:
    f = EventFramer()
    return b"".join(f.feed(c) for c in chunks), f


def test_whole_events_pass_unchanged():
    data = b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    out, f = feed_all([data])
    assert out == data and f.pending == b""


def test_partial_event_is_held_until_complete():
    f = EventFramer()
    assert f.feed(b'data: {"a":') == b""
    assert f.pending == b'data: {"a":'
    assert f.feed(b'1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert f.feed(b":2}\n\n") == b'data: {"b":2}\n\n'


def test_every_split_point_gives_the_same_bytes():
    data = 'data: {"c":"héllo wörld 🚀"}\n\ndata: [DONE]\n\n'.encode()
    for i in range(len(data) + 1):
        out, f = feed_all([data[:i], data[i:]])
        assert out == data, i
        assert f.saw_done


def test_crlf_and_cr_become_lf_even_split_across_chunks():
    crlf = b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    for i in range(len(crlf) + 1):
        out, f = feed_all([crlf[:i], crlf[i:]])
        assert out == b'data: {"a":1}\n\ndata: [DONE]\n\n', i
        assert f.saw_done
    f = EventFramer()
    out = f.feed(b'data: {"a":1}\r\rdata: [DONE]\r\r') + f.finish()
    assert out == b'data: {"a":1}\n\ndata: [DONE]\n\n'


def test_large_event_over_64k_is_one_event():
    payload = json.dumps({"content": "x" * 200_000}).encode()
    data = b"data: " + payload + b"\n\n"
    chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    out, _ = feed_all(chunks)
    assert out == data


def test_usage_found_in_tail():
    usage = (b'data: {"choices":[],"usage":{"prompt_tokens":7,"total_tokens":12,'
             b'"completion_tokens":5}}\n\n')
    _, f = feed_all([b'data: {"choices":[{"delta":{}}]}\n\n', usage, DONE_EVENT])
    assert f.usage() == (7, 5)
    _, f = feed_all([b'data: {"choices":[]}\n\n', DONE_EVENT])
    assert f.usage() is None
    assert extract_usage(b'{"usage": null}') is None


def test_usage_of_the_responses_api():
    """The Responses API names them input and output tokens (its ``*_details`` objects are
    not the counts)."""
    completed = (b'event: response.completed\ndata: {"type":"response.completed","response":'
                 b'{"status":"completed","usage":{"input_tokens":9,"input_tokens_details":'
                 b'{"cached_tokens":2},"output_tokens":4,"output_tokens_details":'
                 b'{"reasoning_tokens":1},"total_tokens":13}}}\n\n')
    created = b'event: response.created\ndata: {"response":{"usage":null}}\n\n'
    _, f = feed_all([created, completed])
    assert f.usage() == (9, 4)


def test_error_event_shape():
    ev = error_event("boom", "upstream_disconnected")
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert json.loads(ev[6:]) == {
        "error": {"message": "boom", "type": "server_error", "param": None,
                  "code": "upstream_disconnected"}
    }


def test_done_marker_however_framed_and_whatever_follows():
    """``data:[DONE]`` (no space: the SSE spec strips at most one), an extra blank line, a
    comment or more data after it: the stream finished (a relay that missed these appended
    an error event and counted the backend as failing)."""
    tok = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    for tail in (b"data:[DONE]\n\n", b"data: [DONE]\n\n\n", b"data: [DONE]\n\n: bye\n\n",
                 b"data: [DONE]\n\ndata: {}\n\n", b"data: [DONE] \r\n\r\n"):
        _, f = feed_all([tok, tail])
        assert f.saw_done, tail
    for not_done in (b'data: {"text":"[DONE]"}\n\n', b"data: [DONE]x\n\n", b": [DONE]\n\n"):
        _, f = feed_all([tok, not_done])
        assert not f.saw_done, not_done


def test_usage_kept_when_events_follow_it():
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    _, f = feed_all([usage, DONE_EVENT, b": keep-alive\n\n", b'data: {"choices":[]}\n\n'])
    assert f.usage() == (3, 4)


def test_comments_alone_are_not_an_event():
    assert not has_event(b": ping\n\n")
    assert not has_event(b"\n\n: a\n: b\n\n")
    assert has_event(b": ping\n\ndata: {}\n\n")
    assert has_event(b"event: error\ndata: {}\n\n")
    assert not has_event(b"retry: 100\n\nid: 7\n\nevent: ping\n\n")


def test_last_event_cut_short_of_its_blank_line_is_released_at_the_end():
    """``data: [DONE]\\n`` or ``data: [DONE]`` then end of body: the OpenAI SDK reads that as
    the end; the framer releases it, completed, and sees the marker."""
    for tail in (b"data: [DONE]\n", b"data: [DONE]", b"data: [DONE]\r"):
        f = EventFramer()
        out = f.feed(b'data: {"a":1}\n\n' + tail) + f.finish()
        assert out == b'data: {"a":1}\n\ndata: [DONE]\n\n' and f.saw_done, tail
    f = EventFramer()
    assert f.feed(b"data: {}\n\n\n") == b"data: {}\n\n\n" and f.finish() == b""


def test_last_event_cut_in_the_middle_is_dropped_at_the_end():
    """A body that ends cleanly inside an event's last line (its backend stopped mid-write):
    the half event (here and there inside a UTF-8 sequence) is never released, so the
    client gets no broken event and the stream has no ``[DONE]``. A whole event short only
    of its line ending or blank line is still released."""
    event = 'data: {"choices":[{"delta":{"content":"wörld"}}]}\n\n'.encode()
    for cut in range(1, len(event) - 1):
        f = EventFramer()
        tail = event[:cut]
        out = f.feed(b'data: {"a":1}\n\n' + tail) + f.finish()
        whole = cut >= len(event) - 2  # only the line ending or the blank line missing
        assert out == b'data: {"a":1}\n\n' + (event if whole else b""), tail
        assert not f.saw_done
    for tail in (b'data: {"a":2}', b'data:{"a":2}\r', b'event: x\ndata: {"a":2}'):
        f = EventFramer()
        assert f.feed(tail) == b"" and f.finish() == tail.rstrip(b"\r") + b"\n\n", tail
    for tail in (b"data: [DON", b"data", b"dat", b": ping", b'data: {"a":1}\nid: 4'):
        f = EventFramer()
        assert f.feed(tail) == b"" and f.finish() == b"", tail


# ---- in-band errors and terminal events (gateway.proxy.inband) ---------------------------

VLLM_ERROR = (b'data: {"error": {"message": "too long", "type": "BadRequestError", '
              b'"param": null, "code": 400}}\n\n')


def test_in_band_error_is_found_whatever_the_split():
    data = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + VLLM_ERROR + DONE_EVENT
    for i in range(len(data) + 1):
        out, f = feed_all([data[:i], data[i:]])
        assert out == data and f.saw_done, i
        assert f.error is not None and f.error.message == "too long", i
        assert f.error.code == 400 and f.error.status == 400


def test_the_word_error_in_a_token_is_not_an_error():
    tokens = [b'data: {"choices":[{"delta":{"content":"error"}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"{\\"error\\": {}}"}}]}\n\n',
              b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
              b'"delta":"error response.failed"}\n\n',
              b'event: response.created\ndata: {"type":"response.created","response":'
              b'{"status":"in_progress","error":null}}\n\n',
              b"data: not json error\n\n"]
    out, f = feed_all(tokens)
    assert out == b"".join(tokens) and f.error is None and f.terminal is None


def test_responses_terminal_and_error_events():
    completed = (b'event: response.completed\ndata: {"type":"response.completed",'
                 b'"response":{"status":"completed","error":null}}\n\n')
    _, f = feed_all([completed])
    assert f.terminal == "response.completed" and f.error is None
    failed = (b'event: response.failed\ndata: {"type":"response.failed","response":'
              b'{"status":"failed","error":{"code":"server_error","message":"boom"}}}\n\n')
    _, f = feed_all([failed])
    assert f.terminal == "response.failed" and f.error is not None
    assert (f.error.message, f.error.code, f.error.status) == ("boom", "server_error", 500)
    error = (b'event: error\ndata: {"type":"error","code":"invalid_prompt","message":"no",'
             b'"param":null,"sequence_number":3}\n\n')
    _, f = feed_all([error])
    assert f.terminal is None and f.error is not None and f.error.message == "no"


def test_in_band_error_status():
    from gateway.proxy.inband import InBandError

    assert InBandError("m", 422).status == 422
    assert InBandError("m", "503").status == 503
    for code in (None, "server_error", 200, 600, True):
        assert InBandError("m", code).status == 500, code


def test_stream_kinds():
    from gateway.proxy.inband import StreamKind, stream_kind

    assert stream_kind("/v1/chat/completions") is StreamKind.DONE
    assert stream_kind("/v1/completions") is StreamKind.DONE
    assert stream_kind("/v1/responses") is StreamKind.RESPONSES
    assert stream_kind("/pooling") is StreamKind.OPEN
