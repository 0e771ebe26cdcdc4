"""Retry-After hints (pure): the bounds every hint of an admission refusal is clamped to, the
Little's-law estimate of when capacity frees, and reading a backend's own hint
(``retry-after`` / ``retry-after-ms``).

Every refusal of :mod:`gateway.traffic.admission`, :mod:`gateway.traffic.limits` and
:mod:`gateway.traffic.scheduler` carries a ``retry-after`` in [1, 60] s (openai-python
honours 0 < value <= 60).
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Iterable

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def clamp_retry_after(seconds: float) -> float:
    """Bound a predicted wait to [1, 60] s (openai-python honours 0 < value <= 60)."""
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))


def retry_after_s(work_ahead: float, service_rate: float) -> float:
    """Predicted seconds until capacity frees for one more request: the work ahead of it
    over the recent service rate (Little's law), bounded to [1, 60] s."""
    if service_rate <= 0:
        return clamp_retry_after(MAX_RETRY_AFTER_S if work_ahead > 0 else MIN_RETRY_AFTER_S)
    return clamp_retry_after(work_ahead / service_rate)


RETRY_AFTER = b"retry-after"
RETRY_AFTER_MS = b"retry-after-ms"
"""OpenAI's millisecond header; openai-python (``_calculate_retry_timeout``) reads it in
preference to ``retry-after``."""


def _positive(seconds: float) -> float | None:
    # a wait that is not finite and positive cannot be honoured: -5, NaN, inf, 0, a past date
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def parse_retry_after(value: str | None, now_unix: float) -> float | None:
    """Seconds in a ``Retry-After`` header (RFC 9110 section 10.2.3: delay-seconds or an
    HTTP-date; ``now_unix``: Unix seconds), or None when absent or unreadable. A value that
    is not a finite positive wait (``-5``, ``nan``, ``inf``, ``0``, a date in the past) is
    unreadable: read as 0 s it would switch a backend's cooling off, so the caller treats it
    like a word (a 429 gets ``retry.default_retry_after_s``)."""
    if not value:
        return None
    value = value.strip()
    try:
        return _positive(float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return _positive(when.timestamp() - now_unix)


def parse_retry_after_ms(value: str | None) -> float | None:
    """Seconds in a ``retry-after-ms`` header (milliseconds, a number: OpenAI's header), or
    None when absent or not a finite positive number (as :func:`parse_retry_after`)."""
    if not value:
        return None
    try:
        ms = float(value.strip())
    except ValueError:
        return None
    return _positive(ms / 1000.0)


def _first(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def backend_retry_after(headers: Iterable[tuple[bytes, bytes]], now_unix: float) -> float | None:
    """Seconds a backend's answer asks to wait (``headers``: lower-case names, as relayed),
    or None when it says nothing readable: ``retry-after-ms`` when readable (the client's
    SDK prefers it), else ``retry-after`` (:func:`parse_retry_after`)."""
    headers = list(headers)
    ms = parse_retry_after_ms(_first(headers, RETRY_AFTER_MS))
    if ms is not None:
        return ms
    return parse_retry_after(_first(headers, RETRY_AFTER), now_unix)


def says_when(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a backend's answer carries ``retry-after`` or ``retry-after-ms`` at all
    (readable or not: relayed as sent, the gateway adds none of its own)."""
    return any(k in (RETRY_AFTER, RETRY_AFTER_MS) for k, _ in headers)
