"""What admission changes in a request's answer and body: OpenAI's rate-limit headers
from the client key's limits (and which of them a backend's answer keeps its own of), and
degraded mode's ``max_tokens`` cap."""

from __future__ import annotations

import json
from collections.abc import Iterable

from gateway.traffic.admission import as_count
from gateway.traffic.limits import EntryVerdict, ratelimit_duration


def ratelimit_headers(v: EntryVerdict) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers."""
    out: dict[str, str] = {}
    if v.limit_requests is not None:
        out["x-ratelimit-limit-requests"] = str(v.limit_requests)
        out["x-ratelimit-remaining-requests"] = str(v.remaining_requests)
        out["x-ratelimit-reset-requests"] = ratelimit_duration(v.reset_requests_s or 0.0)
    if v.limit_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(v.limit_tokens)
        out["x-ratelimit-remaining-tokens"] = str(v.remaining_tokens)
        out["x-ratelimit-reset-tokens"] = ratelimit_duration(v.reset_tokens_s or 0.0)
    return out


_RATELIMIT = b"x-ratelimit-"


def key_limits_for(
    answer_headers: Iterable[tuple[bytes, bytes]], ratelimit: Iterable[tuple[str, str]]
) -> list[tuple[bytes, bytes]]:
    """The client key's ``ratelimit`` headers (:func:`ratelimit_headers` items) to add to
    a backend's answer whose headers are ``answer_headers`` (lower-case names, as
    :func:`gateway.proxy.upstream.response_headers` gives them), latin-1 encoded.

    A backend's own ``x-ratelimit-*`` headers are part of its answer and stay as sent. The
    key's are added per family, the last part of the name (``requests``, ``tokens``: one
    limit / remaining / reset trio each, OpenAI's rate-limit headers,
    https://platform.openai.com/docs/guides/rate-limits): only for a family the backend
    sent no header of, so no name appears twice and no trio mixes the backend's numbers
    with the gateway's."""
    families: set[bytes] | None = None
    out: list[tuple[bytes, bytes]] = []
    for name, value in ratelimit:
        if families is None:
            families = {
                k.rsplit(b"-", 1)[-1] for k, _ in answer_headers if k.startswith(_RATELIMIT)
            }
        k = name.encode("latin-1")
        if k.rsplit(b"-", 1)[-1] not in families:
            out.append((k, value.encode("latin-1")))
    return out


def cap_max_tokens(payload: dict[str, object], cap: int) -> bytes | None:
    """The body re-serialised with ``max_tokens``/``max_completion_tokens`` capped, or None
    when the request already asks for no more than ``cap``."""
    changed = False
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = payload.get(field)
        if v is None and field == "max_tokens" and payload.get("max_completion_tokens") is None:
            payload[field] = cap
            changed = True
        elif (c := as_count(v)) is not None and c > cap:
            payload[field] = cap  # also "3000": vLLM would read it as 3000
            changed = True
    return json.dumps(payload).encode() if changed else None
