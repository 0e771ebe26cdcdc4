"""Which failed attempts may be re-sent to another backend (pure).

A request is retried only before its first byte reached the client (the caller
guarantees this: after that, streams end with an error event instead), never twice to
the same backend, and only for failures that say nothing about the request itself:

* ``connect``: refused, unreachable, connect timeout: the backend never saw the request;
* ``disconnected``: the connection broke before a response (a stale keep-alive socket,
  a backend that died);
* ``status``: the backend answered 5xx;
* ``auth``: the backend refused the gateway's own key (a misconfigured backend; another
  one may be configured right);
* ``drained``: the backend's drain deadline ended the attempt before any answer.

Not retried: ``ttfb_timeout`` (the backend may still be generating; re-sending doubles
load at the worst moment) and every 4xx caused by the request (cases BUG-06/BUG-07).
"""

from __future__ import annotations

RETRYABLE_KINDS = frozenset({"connect", "disconnected", "status", "auth", "drained"})


def should_retry(kind: str, attempt: int, max_attempts: int) -> bool:
    """True if the failure ``kind`` of attempt number ``attempt`` (1-based) may be retried."""
    return attempt < max_attempts and kind in RETRYABLE_KINDS
