"""Request merging: several non-streaming ``/v1/embeddings`` (or ``/v1/completions``)
requests become one upstream request with a list input, and its answer is split back
(pure JSON transforms, no I/O).

Only bodies that the API lets us merge without changing any answer get a merge key:

* embeddings: everything but ``input`` equal (model, ``encoding_format``, ``dimensions``,
  ``user``, any vLLM extra field), inputs all text or all token ids;
* completions: not streaming, one choice per prompt (``n`` and ``best_of`` absent or 1),
  every other field equal (so every sampling parameter, seed included), prompts all text
  or all token ids;
* and, for both, the same query string and the same forwarded headers (a tenant or routing
  header the gateway does not know reaches the backend as the client sent it), except the
  ones that name one request, one client process or a JSON encoding, not what to compute
  (:data:`PER_REQUEST_HEADERS`, ``x-stainless-*``): the merged request carries the first
  member's.

Chat and streams are never merged. The split answer keeps the backend's key order and
compact encoding (vLLM writes JSON with pydantic's compact ``model_dump_json``), so each
member's body is byte for byte what it would have got alone, except for ``id`` /
``created`` (one request's) and ``usage``, which is apportioned: prompt tokens one per
input, the rest in proportion to each member's input size beyond that (exact for token-id
inputs; for text, the bytes of the text, ~4 per token), completion tokens as
``max_tokens`` for choices that finished by ``length`` and the rest in proportion to the
choice text's length. Apportioning uses the largest-remainder method, so the members'
counts add up to the merged request's exactly.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.wire_json import utf8_json
from gateway.traffic.admission import as_count

EMBEDDINGS = "/v1/embeddings"
COMPLETIONS = "/v1/completions"
_FIELD = {EMBEDDINGS: "input", COMPLETIONS: "prompt"}
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_canon = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


class SplitError(ValueError):
    """The merged answer does not have the shape needed to split it."""


@dataclass(frozen=True, slots=True)
class Part:
    """One member of a merge: its payload and its inputs as a list (one or more)."""

    payload: dict[str, Any]
    inputs: list[Any]


def _inputs(value: Any) -> tuple[str, list[Any]] | None:
    """``("text"|"tokens", list of inputs)`` of an ``input``/``prompt`` value, or None
    when it is of no mergeable shape (empty, mixed, nested oddly)."""
    if isinstance(value, str):
        return "text", [value]
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(x, str) for x in value):
        return "text", list(value)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return "tokens", [list(value)]
    if all(
        isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        for x in value
    ):
        return "tokens", [list(x) for x in value]
    return None


# Headers that identify one request, one trace or one client process, or how JSON is
# encoded, not what to compute: members that differ only in these still merge (W3C Trace
# Context; the SDK's user agent).
PER_REQUEST_HEADERS = frozenset(
    {
        "x-request-id",
        "traceparent",
        "tracestate",
        "user-agent",
        "accept",
        "accept-encoding",
        "content-type",
    }
)


def route_key(path: str, headers: dict[str, str], request_id_header: str) -> str:
    """The part of a merge key that comes from the request line and headers: the path with
    its query and every forwarded header but :data:`PER_REQUEST_HEADERS`, the gateway's
    request-id header and the OpenAI SDK's ``x-stainless-*`` (retry count, timeout,
    platform). Requests whose route keys differ are never merged, so no member loses a
    header it sent."""
    skip = PER_REQUEST_HEADERS | {request_id_header.lower()}
    kept = sorted(
        (k, v) for k, v in headers.items() if k not in skip and not k.startswith("x-stainless-")
    )
    return _canon([path, kept])


def merge_key(endpoint: str, payload: dict[str, Any], route: str = "") -> Hashable | None:
    """The key under which ``payload`` may merge with others, or None (never merged).
    ``route``: :func:`route_key` of the request (path, query, headers)."""
    field = _FIELD.get(endpoint)
    if field is None or payload.get("stream") is True:
        return None
    if endpoint == COMPLETIONS:
        if payload.get("n", 1) not in (1, None) or payload.get("best_of", 1) not in (1, None):
            return None
        if payload.get("stream_options") is not None:
            return None
    shaped = _inputs(payload.get(field))
    if shaped is None:
        return None
    if shaped[0] == "text" and not all(_encodable(x) for x in shaped[1]):
        return None  # a lone surrogate ("\ud800", legal JSON): alone, it fails alone
    rest = {k: v for k, v in payload.items() if k != field}
    try:
        return (endpoint, shaped[0], _canon(rest), route)
    except (TypeError, ValueError):
        return None


def _encodable(text: str) -> bool:
    """True when ``text`` is valid Unicode text (UTF-8 encodable: no lone surrogates)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def key_endpoint(key: Hashable | None) -> str | None:
    """The endpoint a :func:`merge_key` key belongs to, or None (no key)."""
    return key[0] if isinstance(key, tuple) else None


MAX_SEQUENCES = 1 << 16


def engine_requests(endpoint: str, payload: dict[str, Any]) -> int:
    """Engine requests (sequences) vLLM makes of one request: embeddings, one per input;
    completions, one per prompt times ``n``; chat, ``n``. 1 for shapes it would refuse
    (its 400 comes back quickly); at most :data:`MAX_SEQUENCES`. ``best_of`` (completions:
    vLLM makes that many candidates and returns the ``n`` best) counts when larger."""
    n = max(as_count(payload.get("n")) or 1,  # "8" is 8 to vLLM's pydantic
            as_count(payload.get("best_of")) or 1)
    field = _FIELD.get(endpoint)
    k = 1
    if field is not None:
        shaped = _inputs(payload.get(field))
        if shaped is not None:
            k = len(shaped[1])
    return min(MAX_SEQUENCES, k if endpoint == EMBEDDINGS else k * n)


def part_of(endpoint: str, payload: dict[str, Any]) -> Part:
    """The member ``payload`` as a :class:`Part` (call only when :func:`merge_key` gave a
    key)."""
    shaped = _inputs(payload[_FIELD[endpoint]])
    assert shaped is not None
    return Part(payload, shaped[1])


def merged_body(endpoint: str, parts: Sequence[Part]) -> bytes:
    """The one upstream body: the first member's fields (all members' are equal but the
    inputs) with every member's inputs, in order, as a list."""
    field = _FIELD[endpoint]
    first = parts[0].payload
    joined = [x for p in parts for x in p.inputs]
    body = {k: (joined if k == field else v) for k, v in first.items()}
    try:
        return _dumps(body).encode()
    except UnicodeEncodeError:  # a lone surrogate in a shared field: as a JSON escape
        return _canon(body).encode()


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` with whole numbers that add up to
    ``total`` (largest-remainder method; equal weights when all are 0)."""
    n = len(weights)
    if n == 0:
        return []
    s = float(sum(weights))
    if s <= 0:
        weights, s = [1.0] * n, float(n)
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    left = total - sum(out)
    order = sorted(range(n), key=lambda i: exact[i] - out[i], reverse=True)
    for i in order[:left]:
        out[i] += 1
    return out


def _size(x: Any) -> float:
    """Size of one input for apportioning prompt tokens: token count, or text bytes."""
    return float(len(x)) if isinstance(x, list) else float(len(x.encode()))


def _usage(
    usage: Any, prompt: int, completion: int | None, cached: int | None = None
) -> dict[str, Any]:
    """A copy of ``usage`` (key order kept) with this member's counts; ``cached``: its
    share of ``prompt_tokens_details.cached_tokens`` (vLLM's
    ``--enable-prompt-tokens-details``), which would otherwise exceed its own prompt."""
    out = dict(usage)
    out["prompt_tokens"] = prompt
    if cached is not None:
        out["prompt_tokens_details"] = {**usage["prompt_tokens_details"], "cached_tokens": cached}
    if completion is not None and "completion_tokens" in out:
        out["completion_tokens"] = completion
    if "total_tokens" in out:
        out["total_tokens"] = prompt + (completion if completion is not None else 0)
    return out


def split_answer(endpoint: str, body: bytes, parts: Sequence[Part]) -> list[bytes]:
    """Each member's answer from the merged one (raises :class:`SplitError`)."""
    try:
        answer = json.loads(body)
    except ValueError as e:
        raise SplitError(f"merged answer is not JSON: {e}") from None
    if not isinstance(answer, dict):
        raise SplitError("merged answer is not an object")
    key = "data" if endpoint == EMBEDDINGS else "choices"
    items = answer.get(key)
    counts = [len(p.inputs) for p in parts]
    if not isinstance(items, list) or len(items) != sum(counts):
        raise SplitError(f"merged answer has no '{key}' list of {sum(counts)} items")
    by_index: dict[int, dict[str, Any]] = {}
    for it in items:
        idx = it.get("index") if isinstance(it, dict) else None
        if not isinstance(idx, int) or idx in by_index:
            raise SplitError(f"bad index in merged '{key}'")
        by_index[idx] = it
    usage = answer.get("usage")
    prompt_shares: list[int] | None = None
    completion_shares: list[int] | None = None
    cached_shares: list[int] | None = None
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        prompt_shares = _prompt_shares(usage["prompt_tokens"], parts)
        if endpoint == COMPLETIONS and isinstance(usage.get("completion_tokens"), int):
            completion_shares = _completion_shares(usage["completion_tokens"], by_index, parts)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached_shares = apportion(
                min(details["cached_tokens"], usage["prompt_tokens"]), prompt_shares
            )
    out: list[bytes] = []
    offset = 0
    for m, c in enumerate(counts):
        mine = []
        for j in range(c):
            it = by_index.get(offset + j)
            if it is None:
                raise SplitError(f"merged answer lacks index {offset + j}")
            it = dict(it)
            it["index"] = j
            mine.append(it)
        offset += c
        member = dict(answer)
        member[key] = mine
        if prompt_shares is not None:
            member["usage"] = _usage(
                usage,
                prompt_shares[m],
                None if completion_shares is None else completion_shares[m],
                None if cached_shares is None else cached_shares[m],
            )
        out.append(utf8_json(member, (",", ":")))
    return out


BYTES_PER_TOKEN = 4.0  # English text with BPE vocabularies (OpenAI's tokenizer guide)


def _prompt_shares(total: int, parts: Sequence[Part]) -> list[int]:
    """Prompt tokens per member, adding up to ``total``: each input costs a fixed number of
    tokens (the special tokens a tokenizer adds to every input: BOS, or CLS and SEP) plus
    its size. Token-id inputs are their own size, so the fixed part is what is left over
    per input (exact when ids are sent as is); text is ``BYTES_PER_TOKEN`` bytes per token,
    the fixed part again what the total leaves per input, at least 1 token and at most an
    equal share. So a one-character input merged with a long text costs its few tokens,
    not a share of the long text's (it was billed ~20x before)."""
    inputs = [x for p in parts for x in p.inputs]
    k = len(inputs)
    sizes = [_size(x) for x in inputs]
    tokens = isinstance(inputs[0], list)
    per_token = 1.0 if tokens else BYTES_PER_TOKEN
    scaled = sum(sizes) / per_token
    lo = 1.0 if total >= k and not tokens else 0.0
    fixed = min(max((total - scaled) / k, lo), total / k)
    rest = total - fixed * k
    size_sum = sum(sizes)
    weights: list[float] = []
    i = 0
    for p in parts:
        w = 0.0
        for _ in p.inputs:
            w += fixed + (rest * sizes[i] / size_sum if size_sum > 0 else rest / k)
            i += 1
        weights.append(w)
    return apportion(total, weights)


def _completion_shares(
    total: int, by_index: dict[int, dict[str, Any]], parts: Sequence[Part]
) -> list[int]:
    """Completion tokens per member: ``max_tokens`` for each choice that stopped by
    ``length`` (exact), the rest by the text length of the other choices (without the
    prompt that ``echo`` puts in front of it)."""
    payload = parts[0].payload
    max_tokens = as_count(payload.get("max_tokens"))
    max_tokens = max_tokens if max_tokens is not None else 16  # vLLM's default
    echo = payload.get("echo") is True
    fixed = [0] * len(parts)
    weights = [0.0] * len(parts)
    offset = 0
    for m, p in enumerate(parts):
        for j in range(len(p.inputs)):
            ch = by_index[offset + j]
            if ch.get("finish_reason") == "length":
                fixed[m] += max_tokens
            else:
                text = ch.get("text")
                n = len(text) if isinstance(text, str) else 0
                prompt = p.inputs[j]
                if echo and isinstance(prompt, str):
                    n = max(0, n - len(prompt))
                weights[m] += n
        offset += len(p.inputs)
    rest = total - sum(fixed)
    if rest < 0:  # clipped by max_model_len: fall back to text lengths for everything
        return apportion(total, [float(f) + w for f, w in zip(fixed, weights, strict=True)])
    return [f + s for f, s in zip(fixed, apportion(rest, weights), strict=True)]
