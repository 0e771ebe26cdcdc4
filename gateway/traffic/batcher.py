"""The predictive batcher's decisions (pure: time comes in as arguments, no I/O).

One queue per priority bucket (high, normal, low), each with ``max_batch_size`` and
``max_wait_s``. A bucket is *due*, and dispatches up to ``max_batch_size`` requests from
its head, when

* ``full``: it holds ``max_batch_size`` requests;
* ``timeout``: its oldest request has waited the bucket's wait budget;
* ``forecast`` (predictive mode only): the arrivals expected before that budget runs out
  (forecast rate x time left, requests) are fewer than the places left in the batch, so
  waiting would only add latency: at low load a request is dispatched the moment it
  arrives;
* ``priority``: a lower bucket is due, and this one (more urgent) holds requests: higher
  priority always dispatches first.

Wait budget (s) = ``min(max_wait_s, slack_share * TTFT-SLO slack)``, where the slack is
the TTFT SLO minus the TTFT currently observed (seed 003: at most half the slack), times
``1 / (1 + interval width / rate)``: the wider the forecast interval relative to the rate,
the less the forecast is trusted and the shorter the wait.

Dispatch binds each request to a backend at that moment through the caller's ``bind``
callback, which reserves a place on a backend that still has room (flow control) and
answers how many requests of the unit it placed (0 when no backend has room; a caller
may also place only the first few): the others stay at the head of their queue, in order,
until a place frees (the caller pumps again) or their queue timeout ends them; they do not
hide the requests behind them that can be placed (another model, another backend): the
dispatch looks past them, up to ``scan_limit`` requests, offering each (model, merge key)
once. Requests that may be merged into one upstream request (same ``merge_key``) are bound
as one unit.

Queue bound: at most ``max_queued`` requests wait in all buckets together; each class may
fill only its share of it (:data:`gateway.traffic.scheduler.QUEUE_SHARE`), and when the
queue is full a more urgent request takes the place of the newest lower one
(:meth:`Batcher.evict_lowest`), exactly as the admission scheduler does without the
batcher: with the batcher on, this queue *is* the admission queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.traffic.scheduler import QUEUE_SHARE

BUCKETS = ("high", "normal", "low")  # index = Prio value


@dataclass(frozen=True, slots=True)
class BucketSettings:
    """``max_batch_size`` (requests) and ``max_wait_s`` (seconds) of one bucket."""

    max_batch_size: int
    max_wait_s: float


@dataclass(slots=True, eq=False)
class Item:
    """One queued request. ``merge_key``: requests with equal non-None keys may be merged
    into one upstream request; ``handle``: the caller's own object (its waiter)."""

    prio: int
    model: str
    enqueued_at: float
    merge_key: Hashable | None = None
    handle: Any = None


@dataclass(slots=True)
class Batch:
    """Requests dispatched together from one bucket, for one reason; ``units`` are the
    groups bound as one (a merge group, or a single request)."""

    prio: int
    reason: str
    units: list[list[Item]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(len(u) for u in self.units)


@dataclass(frozen=True, slots=True)
class RateView:
    """What the batcher reads of a bucket's arrival forecast (requests/s)."""

    rate: float
    low: float
    high: float


def merge_window_limit(size: int, full: int, waited_s: float, budget_s: float, window: int) -> int:
    """How many embeddings upstream requests a backend may already have in flight for a
    merge group of ``size`` requests to be sent to it now (Nagle's algorithm, RFC 896, with
    a window; see :mod:`gateway.flow.batching`): 1 (only to an idle backend) for a small group
    whose oldest request has waited ``waited_s`` < ``budget_s`` (seconds); ``window`` for a
    full group (``size >= full``) or a ripe one. ``window`` 0 disables it (no limit)."""
    if window <= 0:
        return 1 << 30
    if size >= full or waited_s >= budget_s:
        return window
    return 1


class Batcher:
    """Queues and dispatch decisions of the predictive (or fixed-wait) batcher.

    ``predictive`` False gives the fixed-wait batcher: only ``full`` and ``timeout``.
    ``merge_max``: most requests in one merge group. ``scan_limit``: most requests of a
    bucket looked at per dispatch when those at its head cannot be placed.
    """

    def __init__(
        self,
        buckets: Sequence[BucketSettings],
        max_queued: int,
        predictive: bool = True,
        slack_share: float = 0.5,
        merge_max: int = 64,
        scan_limit: int = 256,
    ) -> None:
        if len(buckets) != len(BUCKETS):
            raise ValueError("one BucketSettings per bucket (high, normal, low)")
        self.settings = tuple(buckets)
        self.max_queued = max_queued
        self.predictive = predictive
        self.slack_share = slack_share
        self.merge_max = max(1, merge_max)
        self.scan_limit = max(1, scan_limit)
        self.queues: tuple[deque[Item], ...] = tuple(deque() for _ in BUCKETS)
        self.rates: list[RateView | None] = [None] * len(BUCKETS)
        self.ttft_slack_s: float | None = None
        self._held: list[str | None] = [None] * len(BUCKETS)  # due but blocked: its reason

    # ---- inputs --------------------------------------------------------------------------
    def set_rate(self, prio: int, view: RateView | None) -> None:
        """The bucket's arrival forecast (requests/s), refreshed each forecast tick."""
        self.rates[prio] = view

    def set_slack(self, slack_s: float | None) -> None:
        """TTFT SLO minus the TTFT observed now (s); None when unknown (no cap)."""
        self.ttft_slack_s = None if slack_s is None else max(0.0, slack_s)

    # ---- queue bookkeeping -------------------------------------------------------------
    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.queues)

    def queued_ahead(self, prio: int, model: str | None = None) -> int:
        """Requests that would be dispatched before a new request of ``prio`` (of ``model``
        only, when given: the others go to other backends and do not hold it back)."""
        if model is None:
            return sum(len(self.queues[p]) for p in range(prio + 1))
        return sum(1 for p in range(prio + 1) for it in self.queues[p] if it.model == model)

    def admits(self, prio: int) -> bool:
        """Whether a new request of ``prio`` fits within its class's share of the queue."""
        return self.queued < self.max_queued * QUEUE_SHARE[prio]

    def enqueue(self, item: Item) -> None:
        self.queues[item.prio].append(item)

    def evict_lowest(self, below: int) -> Item | None:
        """Remove and return the newest request of the lowest class strictly below
        ``below`` (it gets a 429), making room for a more urgent one; None if none."""
        for p in range(len(BUCKETS) - 1, below, -1):
            if self.queues[p]:
                item = self.queues[p].pop()
                if not self.queues[p]:
                    self._held[p] = None
                return item
        return None

    def take_all(self) -> list[Item]:
        """Remove and return every queued request, most urgent first (shutdown)."""
        out = [it for q in self.queues for it in q]
        for p, q in enumerate(self.queues):
            q.clear()
            self._held[p] = None
        return out

    def cancel(self, item: Item) -> bool:
        """Take a request out (timed out, client gone); False if it was not queued."""
        q = self.queues[item.prio]
        try:
            q.remove(item)
        except ValueError:
            return False
        if not q:
            self._held[item.prio] = None
        return True

    # ---- decisions ---------------------------------------------------------------------
    def wait_budget(self, prio: int) -> float:
        """Longest a request of ``prio`` may wait for its batch to fill (seconds)."""
        wait = self.settings[prio].max_wait_s
        if self.ttft_slack_s is not None:
            wait = min(wait, self.slack_share * self.ttft_slack_s)
        view = self.rates[prio]
        if self.predictive and view is not None and view.high > 0:
            wait /= 1.0 + (view.high - view.low) / max(view.rate, 1e-9)
        return max(0.0, wait)

    def due(self, prio: int, now: float) -> str | None:
        """Why bucket ``prio`` should dispatch now (full/timeout/forecast), or None."""
        q = self.queues[prio]
        if not q:
            return None
        size = self.settings[prio].max_batch_size
        if len(q) >= size:
            return "full"
        budget = self.wait_budget(prio)
        left = q[0].enqueued_at + budget - now
        if left <= 0:
            return "timeout"
        if self.predictive:
            view = self.rates[prio]
            expected = (view.rate if view is not None else 0.0) * left
            if expected < size - len(q):
                return "forecast"
        return None

    def next_due_at(self) -> float | None:
        """When the earliest waiting (not yet due) bucket times out (monotonic s)."""
        soonest: float | None = None
        for p, q in enumerate(self.queues):
            if q and self._held[p] is None:
                at = q[0].enqueued_at + self.wait_budget(p)
                soonest = at if soonest is None else min(soonest, at)
        return soonest

    @property
    def blocked(self) -> bool:
        """Some due requests wait for a backend with room."""
        return any(r is not None for r in self._held)

    def dispatch(self, now: float, bind: Callable[[list[Item]], int]) -> list[Batch]:
        """Dispatch every due bucket, most urgent first. ``bind(unit)`` reserves one backend
        for the first requests of a unit (one request, or a merge group) and answers how many
        it placed; the rest stay queued, in order. Returns the batches dispatched."""
        reasons = [self._held[p] or self.due(p, now) for p in range(len(BUCKETS))]
        lowest_due = max((p for p, r in enumerate(reasons) if r is not None), default=-1)
        out: list[Batch] = []
        refused: set[tuple[str, Hashable | None]] = set()  # (model, merge key) not placed
        for p in range(lowest_due + 1):
            q = self.queues[p]
            if not q:
                continue
            reason = reasons[p] or "priority"
            batch = Batch(p, reason)
            size = self.settings[p].max_batch_size
            kept: list[Item] = []
            placed = scanned = 0
            # Requests that cannot be placed (their backends are full) must not hide those
            # behind them that can (another model, another backend): past a refused head,
            # the scan goes on, up to scan_limit requests; a (model, merge key) refused once
            # is not offered again in this dispatch (what comes later would wait behind it).
            while q and placed < size and scanned < self.scan_limit:
                window = [q.popleft() for _ in range(min(len(q), size - placed))]
                scanned += len(window)
                for unit in self._units(window):
                    tag = (unit[0].model, unit[0].merge_key)
                    took = 0 if tag in refused else bind(unit)
                    if took > 0:
                        batch.units.append(unit[:took])
                        placed += took
                    if took < len(unit):
                        kept.extend(unit[took:])
                        refused.add(tag)
                if not kept:
                    break  # all placed: what is left is judged afresh
            if kept:
                kept.sort(key=lambda it: it.enqueued_at)
                q.extendleft(reversed(kept))
                self._held[p] = reason
            else:
                self._held[p] = None  # what is left (beyond the window) is judged afresh
            if batch.units:
                out.append(batch)
        return out

    def _units(self, window: list[Item]) -> list[list[Item]]:
        """Split a window into bind units: equal merge keys together (up to ``merge_max``,
        in arrival order), everything else alone."""
        units: list[list[Item]] = []
        groups: dict[Hashable, list[Item]] = {}
        for it in window:
            if it.merge_key is None:
                units.append([it])
                continue
            g = groups.get(it.merge_key)
            if g is None or len(g) >= self.merge_max:
                g = groups[it.merge_key] = [it]
                units.append(g)
            else:
                g.append(it)
        return units
