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
* ``drained``: the backend's drain deadline ended the attempt before any answer;
* ``backend_hung``: the gateway judged the backend hung (silent on its probes and scrapes,
  :mod:`gateway.fleet.liveness`, or a failed stall probe) and ended the attempt before any
  answer.

Not retried: ``ttfb_timeout``/``idle_timeout`` (the backend may still be generating;
re-sending doubles load at the worst moment) and every 4xx caused by the request (cases
BUG-06/BUG-07, tests/cases/test_resilience.py and test_request_validation.py).

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

A re-send off a **hung** backend (``backend_hung``) is counted in the budget (it spends a
retry, so ordinary retries that follow have that much less room, and it shows in
``gateway_retries_total{reason="backend_hung"}``) but is never refused by it
(:meth:`RetryBudget.spend`). The budget exists so that retries cannot multiply the fleet's
load; such a re-send does not add load: the gateway itself cancelled the stuck attempt
(its connection closed, so vLLM aborts it when it runs again) on a backend that was doing
no work, and the request moves rather than doubles. It is bounded all the same: at most one
re-send per request per hung backend (``proxy.max_attempts``, never twice to the same
backend), and the backend is ``unhealthy`` from the detection on (probes and warm-up must
bring it back), so each hang re-sends the requests waiting on it once. Whether they would
have fit anyway: at 20 requests/s over two backends, with suspicion after about 1 s (new
requests avoid the silent backend) and detection after about 2.5 s, the requests stuck on
it are at most those sent to it in its first second of silence plus those it had not
started answering: about 10-15 streams, within the budget's 40 (20% of 200 requests in
10 s); fewer in practice, since the least-loaded router already prefers the other backend
once a few requests sit unanswered on the stopped one (measured with two real vLLM CPU
servers, one stopped for 15 s under 20 requests/s: 2 re-sends, detection after 2.25 s). But
non-streaming generations (nothing is sent before the whole answer) at high concurrency
can leave more stuck than the budget holds (32 clients with 10-s answers: ~16 stuck,
budget 10), and refusing those would turn a backend's hang into client errors although no
byte of their answers was ever sent.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

RETRYABLE_KINDS = frozenset(
    {
        "connect",
        "disconnected",
        "status",
        "bad_answer",
        "rate_limited",
        "auth",
        "drained",
        "backend_hung",
    }
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

    def spend(self) -> None:
        """Count one retry that is made whatever the budget says (a re-send off a hung
        backend, see the module docstring): it takes from the room of later retries."""
        self._bucket()[2] += 1


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
