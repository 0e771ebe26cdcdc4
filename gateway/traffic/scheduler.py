"""The scheduler layer of admission (pure): a global bound on requests in flight, a
bounded priority queue in front of it, and a bound on the time a request may wait there.

:class:`Scheduler` keeps the queue's bookkeeping; the request flow owns the waiting. Times
are monotonic seconds passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gateway.core.vocab import Prio
from gateway.traffic.retry_after import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, clamp_retry_after


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
    :func:`gateway.traffic.retry_after.retry_after_s`.
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
        # requests holding a slot, by class (high, normal, low): fleet mode reports them as
        # each class's demand (gateway.coord.capacity); in_flight is their sum
        self.running: list[int] = [0, 0, 0]
        self.queues: tuple[deque[object], ...] = (deque(), deque(), deque())
        self._rate_window_s = rate_window_s
        self._done: deque[float] = deque()  # finish times within the window
        self._alpha = service_alpha
        self.service_s: float | None = None  # EWMA of the time a request holds its slot
        # times high and normal requests got a slot within the window: the capacity they
        # take before a lower class is served
        self._grants: tuple[deque[float], deque[float]] = (deque(), deque())

    @property
    def in_flight(self) -> int:
        """Requests holding a slot (all classes)."""
        return sum(self.running)

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
            self.running[prio] += 1
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

    def release(self, now: float, held_s: float | None = None, *, prio: Prio) -> object | None:
        """One request of class ``prio`` finished after holding its slot ``held_s`` seconds:
        count it for the service rate and hand its slot to the next waiter (returned,
        already counted as running in its own class), if any."""
        if held_s is not None and held_s >= 0:
            a = self._alpha
            self.service_s = held_s if self.service_s is None else (
                (1 - a) * self.service_s + a * held_s
            )
        self._done.append(now)
        if len(self._done) > 4096:
            self.service_rate(now)
        self.running[prio] = max(0, self.running[prio] - 1)
        # (a bound lowered by resize below the requests running: the slot is not passed on)
        if self.max_in_flight is None or self.in_flight < self.max_in_flight:
            for p, q in enumerate(self.queues):
                if q:
                    self._granted(Prio(p), now)
                    self.running[p] += 1
                    return q.popleft()  # the slot passes on: in_flight unchanged
        return None

    def resize(
        self,
        max_in_flight: int,
        now: float,
        capacity: float | None = None,
        max_queued: int | None = None,
    ) -> list[object]:
        """Change the in-flight bound (fleet mode: this replica's share of the fleet's
        capacity, :func:`gateway.traffic.shares.split`); the capacity for the service rate
        follows it, or ``capacity`` (slots; a steadier figure than a bound that moves every
        round, so predicted waits and Retry-After do not jump with it); and, when given,
        the queue bound ``max_queued`` (fleet mode: the same share of the configured queue,
        so a replica's queue drains at its share of the rate in the time one gateway's
        would, and Retry-After stays what one gateway would say). Returns the waiters that
        get a slot now (the bound grew; most urgent first, already counted as running). A
        lower bound cuts nothing: running requests keep their slots, and freed slots are
        not passed on until in flight is below it; waiters beyond a lower queue bound keep
        their places."""
        self.max_in_flight = max_in_flight
        if max_queued is not None:
            self.max_queued = max_queued
        # (0 for a round: no rate of zero)
        self.capacity = max(1, round(capacity if capacity is not None else max_in_flight))
        woken: list[object] = []
        for p, q in enumerate(self.queues):
            while q and self.in_flight < max_in_flight:
                self.running[p] += 1
                self._granted(Prio(p), now)
                woken.append(q.popleft())
        return woken

    def unbound(self, now: float) -> list[object]:
        """Drop the in-flight bound (the fleet's capacity is no longer known, e.g. a
        discovered backend states no ``max_num_seqs``). Returns every waiter, most urgent
        first, each now counted as running."""
        self.max_in_flight = None
        self.capacity = None
        woken: list[object] = []
        for p, q in enumerate(self.queues):
            while q:
                self.running[p] += 1
                self._granted(Prio(p), now)
                woken.append(q.popleft())
        return woken

    def retry_after(self, prio: Prio, now: float) -> float:
        """Retry-After for a refused request of ``prio``: :meth:`predicted_wait` bounded to
        [1, 60] s (60 when nothing is finishing yet)."""
        if self.service_rate(now) <= 0:
            return self._no_rate_retry()
        return clamp_retry_after(self.predicted_wait(prio, now))
