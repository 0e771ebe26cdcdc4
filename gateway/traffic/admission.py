"""Admission control: who gets in now, who waits, who is told to come back (pure).

Three layers, each with its own rejection reason and metric
(``gateway_admission_rejections_total{layer,priority}``):

1. **entry** (per client key): token buckets for requests per minute and tokens per minute
   (the prompt estimated at 4 bytes per token plus ``max_tokens``), the way OpenAI's own
   ``x-ratelimit-*`` limits work;
2. **scheduler** (global): a bound on requests in flight, a bounded priority queue in front
   of it, and a bound on the time a request may wait there;
3. **resource** (fleet): the queue wait a new request would meet on the least-loaded
   backend, predicted from its scraped queue and its learned concurrency and service rate
   (:mod:`gateway.traffic.capacity`), against the TTFT SLO: ``low`` priority is shed
   first, then ``normal``; ``high`` last. A non-empty vLLM queue alone sheds nothing.

Every rejection carries a ``retry-after`` from :func:`retry_after_s`: the predicted time until
capacity frees (queued work over the recent service rate), bounded to [1, 60] s.

Nothing here does I/O or reads a clock of its own: time comes in as arguments (monotonic
seconds). :class:`Scheduler` keeps the queue's bookkeeping; the pipeline owns the waiting.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.core.vocab import Prio

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def clamp_retry_after(seconds: float) -> float:
    """Bound a predicted wait to [1, 60] s (openai-python honours 0 < value <= 60)."""
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))


def estimate_tokens(
    body_bytes: int, max_tokens: int | None, default_max_tokens: int, sequences: int = 1
) -> int:
    """Tokens a request may cost: prompt estimated at 4 bytes per token (the usual rule of
    thumb for English BPE vocabularies) plus the completion budget (``max_tokens``, or the
    default when it sets none; never negative) of each of its ``sequences`` (prompts x
    ``n``; 0 for embeddings, which generate nothing)."""
    budget = max_tokens if max_tokens is not None else default_max_tokens
    return body_bytes // 4 + sequences * max(0, budget)


MAX_COUNT = 1 << 31


def as_count(value: object) -> int | None:
    """``value`` read as vLLM's pydantic (lax mode) reads an integer field: an int, an
    integral float (``3000.0``) or a numeric string (``"3000"``); None otherwise (bools
    too). Clamped to [0, 2**31]: a negative budget is refused by vLLM, never a credit."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        n = value
    elif isinstance(value, float | str):
        try:
            f = float(value)
        except ValueError:
            return None
        if not math.isfinite(f) or not f.is_integer():
            return None
        n = int(f)
    else:
        return None
    return min(MAX_COUNT, max(0, n))


def completion_budget(payload: dict[str, object]) -> int | None:
    """The most completion tokens one sequence of a request body may make (tokens), or
    None when it sets no budget: the largest of ``max_tokens``, ``max_completion_tokens``
    (vLLM's chat endpoint prefers it, its completions endpoint reads ``max_tokens``) and
    ``max_output_tokens`` (the Responses API). Read as vLLM reads them (:func:`as_count`),
    so ``"3000"`` counts as 3000. Multiply by the sequences (prompts x ``n``)."""
    fields = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    budgets = [c for c in (as_count(payload.get(f)) for f in fields) if c is not None]
    return max(budgets) if budgets else None


# ---- entry layer ---------------------------------------------------------------------------
class TokenBucket:
    """A token bucket of ``capacity`` refilled at ``capacity / period_s`` per second.

    ``per_minute=60`` means 60 per minute with bursts up to 60. Times are seconds.
    """

    __slots__ = ("_at", "capacity", "rate", "tokens")

    def __init__(self, capacity: float, period_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / period_s
        self.tokens = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
            self._at = now

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` could be taken (0: now). ``inf`` if ``n`` exceeds capacity."""
        self._refill(now)
        if n <= self.tokens:
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self.tokens) / self.rate

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.tokens -= n

    def give(self, n: float, now: float) -> None:
        """Return ``n`` taken tokens (never above capacity)."""
        self._refill(now)
        self.tokens = min(self.capacity, self.tokens + n)

    def reset_in(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._refill(now)
        return (self.capacity - self.tokens) / self.rate


@dataclass(frozen=True, slots=True)
class EntryVerdict:
    """Outcome of the entry layer. ``retry_after_s`` is 0 when admitted; the limit fields
    feed the ``x-ratelimit-*`` headers (None when that limit is not configured)."""

    admitted: bool
    retry_after_s: float
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None
    reason: str = ""


class KeyLimiter:
    """Requests-per-minute and tokens-per-minute buckets of one client key."""

    def __init__(self, rpm: int | None, tpm: int | None, now: float) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self.requests = TokenBucket(rpm, 60.0, now) if rpm else None
        self.tokens = TokenBucket(tpm, 60.0, now) if tpm else None

    def full(self, now: float) -> bool:
        """True when every bucket is full again: this limiter is then the same as a new
        one, so it may be dropped (a client seen once does not hold memory forever)."""
        return all(b is None or b.reset_in(now) <= 0.0 for b in (self.requests, self.tokens))

    def refund(self, tokens: int, now: float) -> None:
        """Give back what an admitted request was charged, when a later layer refused it
        (or its client left before it was sent): a refusal must not use up the quota."""
        if self.requests:
            self.requests.give(1, now)
        if self.tokens:
            self.tokens.give(tokens, now)

    def check(self, tokens: int, now: float) -> EntryVerdict:
        """Admit (and charge) one request costing ``tokens``, or say when to come back."""
        wait_r = self.requests.wait_for(1, now) if self.requests else 0.0
        wait_t = self.tokens.wait_for(tokens, now) if self.tokens else 0.0
        admitted = wait_r == 0.0 and wait_t == 0.0
        if admitted:
            if self.requests:
                self.requests.take(1, now)
            if self.tokens:
                self.tokens.take(tokens, now)
        reason = ""
        if wait_t == math.inf:
            reason = (
                f"the request's estimated {tokens} tokens exceed the key's tokens-per-minute limit"
            )
        elif not admitted:
            reason = "requests per minute" if wait_r >= wait_t else "tokens per minute"
        r, t = self.requests, self.tokens
        return EntryVerdict(
            admitted,
            0.0 if admitted else max(wait_r, wait_t),
            self.rpm,
            None if r is None else max(0, math.floor(r.tokens)),
            None if r is None else r.reset_in(now),
            self.tpm,
            None if t is None else max(0, math.floor(t.tokens)),
            None if t is None else t.reset_in(now),
            reason,
        )


def ratelimit_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1.5s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s}s"


# ---- scheduler layer ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SchedulerVerdict:
    """``run`` (go now), ``queue`` (wait for a slot), or ``reject`` (with a retry hint)."""

    action: str
    retry_after_s: float = 0.0
    reason: str = ""


# Share of the queue each class may fill: under saturation low is shed first (at half the
# queue), then normal (at 80%), high only when it is full (and then a low or normal
# waiter gives its place to it).
QUEUE_SHARE = (1.0, 0.8, 0.5)
QUEUE_FULL = "the gateway's queue is full"


class Scheduler:
    """Bookkeeping of the global bound: ``max_in_flight`` running, at most ``max_queued``
    waiting in priority order (high first, FIFO within a class; see :data:`QUEUE_SHARE`).

    The pipeline asks :meth:`offer` for each request; on ``queue`` it parks a waiter and
    registers it with :meth:`enqueue`; every finished request calls :meth:`release`, which
    returns the next waiter to wake (already counted as running). :meth:`service_rate`
    (requests finished per second over the last ``rate_window_s``) feeds
    :func:`retry_after_s`.
    """

    def __init__(
        self,
        max_in_flight: int | None,
        max_queued: int,
        rate_window_s: float = 10.0,
        max_wait_s: float | None = None,
        service_alpha: float = 0.05,
        capacity: int | None = None,
    ) -> None:
        self.max_in_flight = max_in_flight
        # slots the fleet has, for the service rate (default: the in-flight bound; the
        # batcher keeps its own bound and passes the fleet's capacity here)
        self.capacity = capacity if capacity is not None else max_in_flight
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.in_flight = 0
        self.queues: tuple[deque[object], ...] = (deque(), deque(), deque())
        self._rate_window_s = rate_window_s
        self._done: deque[float] = deque()  # finish times within the window
        self._alpha = service_alpha
        self.service_s: float | None = None  # EWMA of the time a request holds its slot
        # times high and normal requests got a slot within the window: the capacity they
        # take before a lower class is served
        self._grants: tuple[deque[float], deque[float]] = (deque(), deque())

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.queues)

    def queued_ahead(self, prio: Prio) -> int:
        """Waiters that would be served before a new request of ``prio``."""
        return sum(len(self.queues[p]) for p in range(prio + 1))

    def offer(self, prio: Prio, now: float) -> SchedulerVerdict:
        """``run`` when a slot is free and nobody waits; ``queue`` when it may wait;
        ``reject`` when its predicted wait (:meth:`predicted_wait`) exceeds ``max_wait_s``
        (an honest 429 now rather than a timeout later) or its class's share of the queue
        is full. A rejection's ``retry_after_s`` is the predicted time until a retry of the
        same priority would be let in (not until it would be served): the predicted wait
        over the bound, or the time for the queue to drain below this class's share."""
        if self.max_in_flight is None or (self.in_flight < self.max_in_flight and self.queued == 0):
            self.in_flight += 1
            self._granted(prio, now)
            return SchedulerVerdict("run")
        if self.max_wait_s is not None and self.service_rate(now) > 0:
            predicted = self.predicted_wait(prio, now)
            if predicted > self.max_wait_s:
                return SchedulerVerdict(
                    "reject",
                    clamp_retry_after(predicted - self.max_wait_s),
                    f"the predicted wait ({predicted:.1f} s) exceeds the queue-wait bound",
                )
        limit = self.max_queued * QUEUE_SHARE[prio]
        if self.queued >= limit:
            # Over this class's share: rejected (when the whole queue is full, a more
            # urgent request may still take the place of a lower waiter: evict_lowest).
            return SchedulerVerdict(
                "reject", self._until_room(prio, self.queued - limit + 1, now), QUEUE_FULL
            )
        return SchedulerVerdict("queue")

    def _until_room(self, prio: Prio, excess: float, now: float) -> float:
        """Seconds (bounded to [1, 60]) until ``excess`` more waiters have been served at
        the capacity the more urgent classes leave to ``prio``."""
        rate = self.service_rate(now)
        if rate <= 0:
            return self._no_rate_retry()
        left = rate - self.rate_above(prio, now)
        return clamp_retry_after(excess / left if left > 0 else math.inf)

    def _no_rate_retry(self) -> float:
        """Retry-After without a service rate: 1 s before any request has ever finished
        (just started: nothing is known, a quick retry finds an estimate), else 60 s
        (requests ran, none finished lately: the fleet is stuck)."""
        return MIN_RETRY_AFTER_S if self.service_s is None else MAX_RETRY_AFTER_S

    def _granted(self, prio: Prio, now: float) -> None:
        if prio < Prio.LOW:
            q = self._grants[prio]
            q.append(now)
            horizon = now - self._rate_window_s
            while q and q[0] < horizon:
                q.popleft()

    def rate_above(self, prio: Prio, now: float) -> float:
        """Slots per second taken by the classes served before ``prio`` (over the last
        ``rate_window_s``)."""
        horizon = now - self._rate_window_s
        total = 0
        for p in range(prio):
            q = self._grants[p]
            while q and q[0] < horizon:
                q.popleft()
            total += len(q)
        return total / self._rate_window_s

    def predicted_wait(self, prio: Prio, now: float, ahead: int | None = None) -> float:
        """Seconds until a new request of ``prio`` would get a slot (unclamped; ``inf`` when
        it would never): the waiters served before it (``ahead``; default this scheduler's
        own queue, the batcher passes its buckets'), plus itself, over the capacity left by
        the more urgent classes, ``(ahead + 1) / (mu - lambda_higher)`` with
        ``lambda_higher`` the rate at which they took slots lately (the priority-queue form
        of Little's law; Kleinrock, *Queueing Systems* vol. 2, 3.7)."""
        left = self.service_rate(now) - self.rate_above(prio, now)
        if left <= 0:
            return math.inf
        if ahead is None:
            ahead = self.queued_ahead(prio)
        return (ahead + 1) / left

    def enqueue(self, prio: Prio, waiter: object) -> None:
        self.queues[prio].append(waiter)

    def evict_lowest(self, below: Prio) -> object | None:
        """Remove the newest waiter of the lowest class strictly below ``below`` (it gets a
        429), making room for a more urgent request. None if there is none."""
        for p in (Prio.LOW, Prio.NORMAL):
            if p > below and self.queues[p]:
                return self.queues[p].pop()
        return None

    def take_all(self) -> list[object]:
        """Remove and return every queued waiter, most urgent first (shutdown)."""
        out = [w for q in self.queues for w in q]
        for q in self.queues:
            q.clear()
        return out

    def cancel(self, prio: Prio, waiter: object) -> None:
        """A waiter gave up (timeout, client gone)."""
        try:
            self.queues[prio].remove(waiter)
        except ValueError:
            pass

    def service_rate(self, now: float) -> float:
        """Requests per second the slots can finish when busy: ``capacity`` (default
        ``max_in_flight``) over the mean time a request holds its slot (an EWMA, so idle
        periods do not make the fleet look slow); before any request has ended, or without
        a capacity, the requests that finished per second over the last ``rate_window_s``."""
        if self.capacity is not None and self.service_s:
            return self.capacity / self.service_s
        horizon = now - self._rate_window_s
        done = self._done
        while done and done[0] < horizon:
            done.popleft()
        return len(done) / self._rate_window_s

    def release(self, now: float, held_s: float | None = None) -> object | None:
        """One request finished after holding its slot ``held_s`` seconds: count it for the
        service rate and hand its slot to the next waiter (returned, already counted as
        running), if any."""
        if held_s is not None and held_s >= 0:
            a = self._alpha
            self.service_s = held_s if self.service_s is None else (
                (1 - a) * self.service_s + a * held_s
            )
        self._done.append(now)
        if len(self._done) > 4096:
            self.service_rate(now)
        for p, q in enumerate(self.queues):
            if q:
                self._granted(Prio(p), now)
                return q.popleft()  # the slot passes on: in_flight unchanged
        self.in_flight -= 1
        return None

    def retry_after(self, prio: Prio, now: float) -> float:
        """Retry-After for a refused request of ``prio``: :meth:`predicted_wait` bounded to
        [1, 60] s (60 when nothing is finishing yet)."""
        if self.service_rate(now) <= 0:
            return self._no_rate_retry()
        return clamp_retry_after(self.predicted_wait(prio, now))


def retry_after_s(work_ahead: float, service_rate: float) -> float:
    """Predicted seconds until capacity frees for one more request: the work ahead of it
    over the recent service rate (Little's law), bounded to [1, 60] s."""
    if service_rate <= 0:
        return clamp_retry_after(MAX_RETRY_AFTER_S if work_ahead > 0 else MIN_RETRY_AFTER_S)
    return clamp_retry_after(work_ahead / service_rate)


# ---- resource layer ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Saturation:
    """How overloaded the fleet serving one model is: the predicted queue wait of a new
    request in units of the TTFT SLO (0: it would start at once; 1: it would wait a whole
    SLO before its prefill starts), or for the power layer the draw over the budget."""

    level: float


def pool_wait(waits: Iterable[float]) -> float:
    """The least predicted queue wait (seconds) among a model's routable backends, 0 with
    none: the router sends a request to the least-loaded one, so that is the wait it meets.
    Each wait comes from :meth:`gateway.traffic.capacity.ServiceModel.predicted_wait`."""
    best: float | None = None
    for w in waits:
        best = w if best is None else min(best, w)
    return 0.0 if best is None else best


def wait_level(wait_s: float, slo_ttft_s: float) -> Saturation:
    """The resource layer's saturation: predicted queue wait ``wait_s`` over the TTFT SLO
    ``slo_ttft_s`` (both seconds). A backend's own queue is not an overload; a wait that
    makes the request miss its SLO by a margin is (``admission.shed_levels``)."""
    return Saturation(wait_s / slo_ttft_s if slo_ttft_s > 0 else math.inf)


def shed_retry_after(wait_s: float, level: float, slo_ttft_s: float) -> float:
    """Retry-After (seconds, bounded to [1, 60]) of a request shed at predicted wait
    ``wait_s`` by a class shed from ``level`` x ``slo_ttft_s``: the queue drains one second
    of wait per second, so a retry after the excess would be let in (arrivals meanwhile
    aside)."""
    return clamp_retry_after(wait_s - level * slo_ttft_s)


def shed(prio: Prio, saturation: Saturation, thresholds: tuple[float, float, float]) -> bool:
    """Whether a request of ``prio`` is shed at this saturation. ``thresholds`` are the
    levels at which high, normal and low requests are shed (low sheds first)."""
    return saturation.level >= thresholds[prio]


# ---- degraded mode -----------------------------------------------------------------------
class DegradedMode:
    """Under sustained overload, cap ``max_tokens`` and refuse long low-priority prompts;
    lift it one step at a time while P99 TTFT stays under the SLO.

    Level 0 is normal. Each :meth:`update` (about once a second) raises the level by one after
    ``enter_after_s`` of continuous overload (up to ``max_level``), and lowers it by one
    after every ``step_s`` with P99 TTFT under the SLO. The cap halves with each level.
    """

    def __init__(self, enter_after_s: float, step_s: float, max_level: int = 3) -> None:
        self.enter_after_s = enter_after_s
        self.step_s = step_s
        self.max_level = max_level
        self.level = 0
        self._over_since: float | None = None
        self._ok_since: float | None = None

    def update(self, overloaded: bool, now: float) -> int:
        if overloaded:
            self._ok_since = None
            if self._over_since is None:
                self._over_since = now
            elif now - self._over_since >= self.enter_after_s and self.level < self.max_level:
                self.level += 1
                self._over_since = now
        else:
            self._over_since = None
            if self.level > 0:
                if self._ok_since is None:
                    self._ok_since = now
                elif now - self._ok_since >= self.step_s:
                    self.level -= 1
                    self._ok_since = now
        return self.level

    def max_tokens_cap(self, base_cap: int) -> int | None:
        """The ``max_tokens`` cap now (None: no cap)."""
        if self.level == 0:
            return None
        return max(1, base_cap >> (self.level - 1))
