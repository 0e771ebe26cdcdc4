"""Hypothesis strategies of what clients send (issue 20): JSON values of every type, bodies of
the model routes with any field the gateway reads set to anything, and the byte-level
oddities JSON allows or breaks (lone surrogates, invalid UTF-8, deep nesting, huge
numbers)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.lifecycle.support import LINES, MODEL

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")

# Every body field the gateway itself reads (gateway/api/parsing.py, forms.py, openai.py;
# gateway/traffic/estimate.py and admission.py; gateway/flow/merging.py, shaping.py,
# continuing.py, responses.py; gateway/proxy/continuation.py) and a few it forwards.
FIELDS = (
    "model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "max_output_tokens", "n", "best_of", "echo", "logprobs",
    "prompt_logprobs", "return_token_ids", "previous_response_id", "tools", "tool_choice",
    "stop", "response_format", "min_tokens", "continue_final_message",
    "add_generation_prompt", "user", "temperature", "seed", "encoding_format", "dimensions",
    "instructions", "priority", "ignore_eos",
)

# Any code point, and often the awkward ones: lone surrogates (JSON escapes them as "\ud800"),
# NUL, line separators, multi-byte and astral characters.
ANY_CHAR = st.characters(codec=None, exclude_categories=()) | st.sampled_from(
    ["\ud800", "\udfff", "\x00", "\u2028", "\r", "\n", "é", "\U0001f600"])
AWKWARD = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\u2028\u2029",
                           "é" * 3, "\U0001f600", "\ufeff", "data: [DONE]\n\n", "\r\n"])
TEXT = AWKWARD | st.text(ANY_CHAR, max_size=12)
HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 2**70, -(2**70), 10**300])

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-5, 40)
    | HUGE_INTS
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
    | st.sampled_from(["", MODEL, "m1 ", "3", "1e400", "high", "true", "[DONE]", "data:"])
)

JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(FIELDS) | TEXT, inner, max_size=3),
    max_leaves=8,
)

# Well-typed values for the fields, so that bodies also get past the edge's checks and
# reach admission, the batcher, continuation and the backends.
TYPED: dict[str, Any] = {
    "stream": st.booleans(),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": False},
                                       {"continuous_usage_stats": True}]),
    "max_tokens": st.integers(0, 16) | HUGE_INTS,
    "max_completion_tokens": st.integers(0, 16),
    "max_output_tokens": st.integers(0, 16),
    "n": st.integers(0, 3),
    "best_of": st.integers(0, 3),
    "echo": st.booleans(),
    "logprobs": st.booleans() | st.integers(0, 3),
    "return_token_ids": st.booleans(),
    "continue_final_message": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_1", "", "../x", "%2e%2e"]) | TEXT,
    "prompt": TEXT | st.lists(st.integers(0, 100), max_size=4) | st.lists(TEXT, max_size=3),
    "input": TEXT | st.lists(TEXT, max_size=3) | st.lists(st.integers(0, 100), max_size=4),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(
        ["user", "assistant", "system", "tool", ""]), "content": TEXT | JSON}), max_size=3),
}


def base_body(endpoint: str) -> dict[str, Any]:
    """A valid small body for ``endpoint`` (model ``m1``, answered within 8 tokens)."""
    if endpoint == "/v1/chat/completions":
        return {"model": MODEL, "messages": LINES, "max_tokens": 4}
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    if endpoint == "/v1/embeddings":
        return {"model": MODEL, "input": "hello"}
    return {"model": MODEL, "input": "hello", "max_output_tokens": 4}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any] | Any]:
    """(endpoint, body): a valid body with some fields set to typed or arbitrary values or
    removed, or, now and then, any JSON value at all."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    if draw(st.integers(0, 9)) == 0:
        return endpoint, draw(JSON)
    body = base_body(endpoint)
    body["stream"] = draw(st.booleans())  # streams and answers alike
    if draw(st.booleans()):  # awkward text where the prompt is
        text = draw(AWKWARD | TEXT)
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt" if endpoint == "/v1/completions" else "input"] = text
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        how = draw(st.sampled_from(["typed", "any", "drop"]))
        if how == "drop":
            body.pop(field, None)
        elif how == "typed" and field in TYPED:
            body[field] = draw(TYPED[field])
        else:
            body[field] = draw(JSON)
    return endpoint, body


def encode(value: Any, ascii_only: bool) -> bytes:
    """``value`` as JSON bytes: with ``\\uXXXX`` escapes (lone surrogates stay legal JSON),
    or as raw UTF-8 with a lone surrogate written as its (invalid) three UTF-8 bytes."""
    if ascii_only:
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, bytes) that break JSON or the text in it: invalid UTF-8 (raw bytes spliced
    into a valid body, overlong forms, a raw surrogate), deep nesting, huge numbers, long
    digit strings, truncation, non-object tops."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    body = encode(base_body(endpoint), True)
    kind = draw(st.sampled_from(
        ["splice", "deep", "number", "digits", "truncate", "escape", "top", "dup"]))
    if kind == "splice":  # invalid UTF-8 inside a string value
        bad = draw(st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82",
                                    b"\x80\x80", b"\xf4\x90\x80\x80"]) | st.binary(max_size=6))
        at = body.index(b'"model": "') + len(b'"model": "')
        return endpoint, body[:at] + bad + body[at:]
    if kind == "deep":  # nested past any recursion limit, in a field the walk reads
        depth = draw(st.sampled_from([100, 1000, 5000, 100_000]))
        opener = draw(st.sampled_from([b"[", b'{"a":']))
        closer = b"]" if opener == b"[" else b"}"
        field = draw(st.sampled_from([b"messages", b"prompt", b"input", b"tools", b"x"]))
        return endpoint, (body[:-1] + b', "' + field + b'": ' + opener * depth + b"1"
                          + closer * depth + b"}")
    if kind == "number":
        num = draw(st.sampled_from([b"1e400", b"-1e400", b"1e-400", b"2e308", b"NaN",
                                    b"Infinity", b"-Infinity", b"1" + b"0" * 30,
                                    b"123456789012345678901234567890.5e10", b"-0", b"0e0"]))
        field = draw(st.sampled_from([b"max_tokens", b"n", b"max_completion_tokens",
                                      b"best_of", b"temperature", b"stream"]))
        return endpoint, body[:-1] + b', "' + field + b'": ' + num + b"}"
    if kind == "digits":  # past CPython's int max_str_digits (4300)
        n = draw(st.sampled_from([4301, 20_000, 100_000]))
        return endpoint, body[:-1] + b', "max_tokens": ' + b"9" * n + b"}"
    if kind == "truncate":
        return endpoint, body[: draw(st.integers(0, len(body) - 1))]
    if kind == "escape":  # lone and broken surrogate escapes in text fields
        esc = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"\\udc00\\ud800",
                                    b"\\u0000", b"\\uZZZZ", b"\\", b"\\x41"]))
        field = draw(st.sampled_from([b"model", b"user", b"x"]))
        return endpoint, body[:-1] + b', "' + field + b'": "a' + esc + b'"}'
    if kind == "top":
        return endpoint, draw(st.sampled_from(
            [b"", b"null", b"[]", b"1", b'"x"', b"\xef\xbb\xbf{}", b"{}{}", b" ", b"\x00"]))
    return endpoint, body[:-1] + b', "model": 7, "model": "m1"}'  # dup keys: the last wins
