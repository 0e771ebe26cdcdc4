"""What admission changes in a request's answer and body: OpenAI's rate-limit headers
from the client key's limits, and degraded mode's ``max_tokens`` cap."""

from __future__ import annotations

import json

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
