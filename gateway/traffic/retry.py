"""Retries: which failures may be re-sent, when, and how many the fleet can afford.

A request is retried only before its first byte reached the client (the pipeline
guarantees this: after that, streams end with an error event instead), never twice to the
same backend, and only for failures that say nothing about the request itself:

* ``connect``: refused, unreachable, connect timeout: the backend never saw the request;
* ``disconnected``: the connection broke before a response (a stale keep-alive socket,
  a backend that died);
* ``status``: the backend answered 5xx;
* ``rate_limited``: the backend answered 429 (it cools down for its ``Retry-After``);
* ``auth``: the backend refused the gateway's own key, and the probes found it refusing it
  too (``config_error``: a misconfigured backend; another one may be configured right);
  a 401/403 from a backend whose key works elsewhere is about the request: passed through;
* ``drained``: the backend's drain deadline ended the attempt before any answer.

Not retried: ``ttfb_timeout``/``idle_timeout`` (the backend may still be generating;
re-sending doubles load at the worst moment) and every 4xx caused by the request (cases
BUG-06/BUG-07 in ../shared/cases).

**Backoff**: exponential with full jitter (AWS Architecture Blog, "Exponential Backoff And
Jitter", 2015): before retry *n*, sleep ``uniform(0, min(max, base * 2**(n-1)))``. Retries
after the first run under tenacity's ``AsyncRetrying`` with ``wait_random_exponential``;
the first retry computes the same full-jitter delay itself, because building an
``AsyncRetrying`` costs about 66 us, measured here: as much as the whole data path, and
most requests never retry.

**Retry budget** (Finagle's ``RetryBudget``: 20% of requests over a 10 s window plus a
minimum rate of retries per second; Envoy's ``retry_budget`` is the same idea over active
requests): retries may be at most ``ratio`` of the requests seen in the last ``window_s``
seconds, or ``min_per_s`` per second of the window when that is larger, so that a failing
fleet cannot multiply its own load while a quiet one can still fail over.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

RETRYABLE_KINDS = frozenset(
    {"connect", "disconnected", "status", "rate_limited", "auth", "drained"}
)


def should_retry(kind: str, attempt: int, max_attempts: int) -> bool:
    """True if the failure ``kind`` of attempt number ``attempt`` (1-based) may be retried
    (ignoring the budget)."""
    return attempt < max_attempts and kind in RETRYABLE_KINDS


class RetryBudget:
    """Retries <= ``ratio`` x requests over the last ``window_s`` seconds, or
    ``min_per_s * window_s``, whichever is larger. ``clock``: monotonic seconds."""

    def __init__(
        self, ratio: float, window_s: float, min_per_s: float, clock: Callable[[], float]
    ) -> None:
        self.ratio = ratio
        self.window_s = window_s
        self.min_retries = int(min_per_s * window_s)
        self._clock = clock
        # 1-second buckets: [second, requests, retries]
        self._buckets: deque[list[int]] = deque()

    def _bucket(self) -> list[int]:
        now = self._clock()
        second = int(now)
        b = self._buckets
        if not b or b[-1][0] != second:
            b.append([second, 0, 0])
            horizon = now - self.window_s
            while b and b[0][0] < horizon:
                b.popleft()
        return b[-1]

    def record_request(self) -> None:
        """Count one client request (call once per request, not per attempt)."""
        self._bucket()[1] += 1

    def allowed(self) -> int:
        """Retries the budget allows in the current window."""
        self._bucket()
        requests = sum(x[1] for x in self._buckets)
        return max(self.min_retries, int(self.ratio * requests))

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and nothing taken) when it is spent."""
        bucket = self._bucket()
        retries = sum(x[2] for x in self._buckets)
        if retries >= self.allowed():
            return False
        bucket[2] += 1
        return True


class RetryPolicy:
    """Backoff between retries (full jitter) and the tenacity loop for the later ones."""

    def __init__(
        self, backoff_base_s: float, backoff_max_s: float, rng: random.Random | None = None
    ) -> None:
        self.base = backoff_base_s
        self.max = backoff_max_s
        self._rng = rng or random.Random()
        # tenacity's attempt k (k >= 1) is our retry k + 1: base * 2**k
        self.wait = wait_random_exponential(multiplier=2 * backoff_base_s, max=backoff_max_s)

    def first_delay(self) -> float:
        """Full-jitter delay before the first retry: ``uniform(0, base)`` seconds."""
        return self._rng.uniform(0.0, min(self.base, self.max))

    async def pause(self) -> None:
        delay = self.first_delay()
        if delay > 0:
            await asyncio.sleep(delay)

    def retrying(self, attempts: int, may_retry: Callable[[BaseException], bool]) -> AsyncRetrying:
        """tenacity's loop for ``attempts`` more attempts, each retried only when
        ``may_retry(exception)``; the last exception is re-raised."""
        return AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=self.wait,
            retry=retry_if_exception(may_retry),
            reraise=True,
        )
