"""The asyncio side of the predictive batcher (its forecasts: :mod:`gateway.flow.forecasts`).

:class:`BatchDispatcher` drives :class:`gateway.traffic.batcher.Batcher`: a request that
passed admission waits in its bucket (:meth:`BatchDispatcher.acquire`) until a dispatch
binds it to a backend with room; every decision is taken by the pure batcher, re-run
(:meth:`BatchDispatcher.pump`) when a request arrives, when a backend slot frees, and on a
timer for the earliest wait budget. With the batcher on, its buckets are the admission
queue: the admission scheduler no longer queues (see :class:`gateway.flow.admission.AdmissionGate`),
and this queue applies ``admission.max_queued``, the class shares, eviction and
``admission.max_queue_wait_s``, answering 429 with ``retry-after`` from the admission layer.

A request dispatched alone gets its backend and runs through the pipeline as usual. A
merge group (equal :func:`gateway.flow.merging.merge_key`) runs here as one upstream
request on its backend; its answer is split and each member gets its share, or, when the
merged request fails in any way, each member is sent again alone (so one bad input cannot
fail its neighbours).

Flow control counts what the engine will run, in sequences: a request of k prompts (times
``n``) takes k places, merged or not; an embeddings request takes one (its inputs are
prefill-only sequences of one engine step). Embeddings upstream requests also follow
Nagle's algorithm (RFC 896: a small segment is sent at once while nothing is outstanding,
else held until the answer comes back; a full one goes anyway) with a window, per backend
and merge key (requests that cannot merge never wait for one another): a backend with no
embeddings request of the key in flight takes the next group at once, whatever its size (at
low load nothing waits); one with some in flight takes a full group (the bucket's
``max_batch_size``) or one whose oldest request has waited its wait budget, up to
``batcher.merge_window`` in flight; the rest wait in the gateway and merge, so merged
requests grow with the load instead of being cut at a fixed wait. Embeddings only: they
are prefill-only, an upstream request returns within one engine step, so holding the next
one costs little, while each HTTP request costs vLLM's single API-server process a fixed
CPU time (measured on its CPU build, ``benchmarks/embed_merge_real.py --costs``: about
1.1 ms per request plus 0.5 ms per input), the bottleneck of small embeddings.

Once dispatched into a merged request, a member is out of the queue (the queue timeout no
longer applies to it); when every member's client has gone, the merged request is cancelled
(and with it the generation on the backend).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Hashable, Sized
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig
from gateway.core.outcomes import Refusal, shutting_down
from gateway.core.vocab import Prio
from gateway.fleet.backend import Backend
from gateway.fleet.feedback import FleetFeedback
from gateway.fleet.fleet import Fleet
from gateway.flow.admission import AdmissionGate, Evicted, ShuttingDown
from gateway.flow.context import Answer, RequestContext
from gateway.flow.lease import Hold, RequestLease
from gateway.flow.merged import UNMERGED, MergedRequests, Waiter, has_result
from gateway.flow.pipeline import Pipeline
from gateway.flow.placement import Placement
from gateway.metrics import GatewayMetrics
from gateway.routing.policies import Policy
from gateway.traffic.batcher import (
    BUCKETS,
    Batcher,
    BucketSettings,
    Item,
)
from gateway.traffic.retry_after import retry_after_s

log = logging.getLogger("gateway.flow.batching")



@dataclass(slots=True)
class _Children:
    size: Any
    wait: Any
    reasons: dict[str, Any] = field(default_factory=dict)


class BatchDispatcher:
    """One per app (built when ``batcher.enabled``). ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        pipeline: Pipeline,
        router: Policy,
        gate: AdmissionGate,
        metrics: GatewayMetrics,
        signals: FleetFeedback,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        b = cfg.batcher
        self.cfg = cfg
        self.core = Batcher(
            [
                BucketSettings(s.max_batch_size, s.max_wait_ms / 1000.0)
                for s in (b.high, b.normal, b.low)
            ],
            cfg.admission.max_queued,
            predictive=b.predictive,
            slack_share=b.slack_share,
            merge_max=b.merge_max,
        )
        self.merge = b.merge
        self.fleet = fleet
        self.signals = signals
        self.pipeline = pipeline
        self.router = router
        self.gate = gate
        self.metrics = metrics
        self.clock = clock
        self.queue_timeout_s = cfg.admission.max_queue_wait_s
        self.shut = False  # shutting down: nothing more is queued or dispatched
        self.placement = Placement(b, self.core, fleet, router)
        self.merged = MergedRequests(
            pipeline, metrics, self.new_lease, self.placement.reserve, self._deliver
        )
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._tasks: set[asyncio.Task[None]] = set()
        self._children = [
            _Children(metrics.batch_size.labels(n), metrics.batch_wait.labels(n)) for n in BUCKETS
        ]
        for prio, name in enumerate(BUCKETS):
            metrics.queue_depth.labels(name).set_function(_length_of(self.core.queues[prio]))

    def reconfigure(self, cfg: GatewayConfig) -> None:
        """A live reload's ``admission``: the queue's bound (``max_queued``) and wait
        (``max_queue_wait_s``) for requests queued from now on."""
        self.cfg = cfg
        self.core.max_queued = cfg.admission.max_queued
        self.queue_timeout_s = cfg.admission.max_queue_wait_s

    # ---- the request's side ----------------------------------------------------------
    @property
    def pending(self) -> dict[str, int]:
        """Places reserved per backend id for dispatched requests not yet started."""
        return self.placement.pending

    @property
    def merge_flight(self) -> dict[Hashable, int]:
        """Embeddings upstream requests in flight per (backend id, merge key)."""
        return self.placement.merge_flight

    def new_lease(self) -> RequestLease:
        """A lease whose freed backend slots wake the queue (:meth:`slot_freed`)."""
        return RequestLease(self.signals, self.slot_freed)

    async def acquire(self, ctx: RequestContext) -> Backend | Answer | None:
        """Wait in the request's bucket until dispatched. Returns the backend bound to it
        (its places reserved there on ``ctx.lease``; None: no backend can take the model
        at all, the pipeline answers that), or the request's share of a merged answer.
        Raises :class:`Refusal`: a 429 when the queue is full, the predicted wait is too
        long or the queue timeout passed; a 503 when the gateway is shutting down."""
        while True:
            got = await self._wait_once(ctx)
            if got is UNMERGED:
                ctx.merge_key = None  # the merge failed: again, alone
                continue
            return got  # type: ignore[no-any-return]  # the waiter's future holds Any

    async def _wait_once(self, ctx: RequestContext) -> Any:
        core = self.core
        prio = ctx.priority
        now = self.clock()
        if self.shut:  # (a merged request's member, sent back to be sent alone)
            raise shutting_down()
        if core.blocked:  # requests already wait for room: would this one wait too long?
            wait = self._predicted_wait(prio, ctx.model, now)
            if wait > self.queue_timeout_s:
                raise self._reject(
                    ctx,
                    f"The gateway is at capacity: the predicted wait ({wait:.1f} s) exceeds "
                    f"admission.max_queue_wait_s ({self.queue_timeout_s:g} s).",
                    now,
                    max(0.0, wait - self.queue_timeout_s),  # until it would be let in
                )
        if not core.admits(prio):
            evicted = core.evict_lowest(prio) if core.queued >= core.max_queued else None
            if evicted is None:
                raise self._reject(
                    ctx,
                    f"The gateway's queue is full; {BUCKETS[prio]}-priority requests are shed.",
                    now,
                )
            if not evicted.handle.fut.done():
                evicted.handle.fut.set_exception(Evicted())
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiter = Waiter(ctx, fut)
        item = Item(prio, ctx.model, now, ctx.merge_key, waiter)
        core.enqueue(item)
        self.pump()
        if not fut.done():
            try:
                # (dispatched already, by the pump above, into a merged request: no timeout)
                limit = None if waiter.riding else self.queue_timeout_s
                async with asyncio.timeout(limit) as waiter.deadline:
                    await fut
            except TimeoutError:
                if not has_result(fut):
                    core.cancel(item)
                    raise self._reject(
                        ctx,
                        "No capacity freed within "
                        f"{self.queue_timeout_s:g} s (admission.max_queue_wait_s).",
                        self.clock(),
                    ) from None
            except ShuttingDown:
                raise shutting_down() from None
            except Evicted:
                raise self._reject(
                    ctx,
                    "The gateway's queue is full; this "
                    f"{BUCKETS[prio]}-priority request gave its place to a more urgent one.",
                    self.clock(),
                ) from None
            except asyncio.CancelledError:
                if not has_result(fut):
                    core.cancel(item)
                raise  # (a reservation made for it is on its lease, given back there)
        return fut.result()

    def shed_queued(self) -> int:
        """Shutdown: nothing more is dispatched; every queued request gets 503
        ``gateway_shutting_down`` now (never sent, so another instance can take it), and so
        does a merged request's member that would be sent again alone. Returns how many."""
        self.shut = True
        items = self.core.take_all()
        for it in items:
            fut = it.handle.fut
            if not fut.done():
                fut.set_exception(ShuttingDown())
        return len(items)

    def _predicted_wait(self, prio: int, model: str, now: float) -> float:
        """Seconds until a new request of ``prio`` for ``model`` would be dispatched: the
        requests of its model ahead of it, plus itself, over the capacity the more urgent
        classes leave (the admission scheduler's service and arrival rates; its
        :meth:`predicted_wait` formula). Another model's queue does not count: the dispatch
        looks past it (a request for an idle model was refused behind a full one)."""
        s = self.gate.scheduler
        if s.service_rate(now) <= 0:
            return 0.0  # nothing known yet: no prediction to refuse on
        ahead = self.core.queued_ahead(prio, model)
        if ahead == 0:
            return 0.0  # nothing of its model waits: it goes as soon as a backend has room
        return s.predicted_wait(Prio(prio), now, ahead)

    def _reject(
        self, ctx: RequestContext, message: str, now: float, wait: float | None = None
    ) -> Refusal:
        retry = (
            wait
            if wait is not None
            else retry_after_s(
                self.core.queued_ahead(ctx.priority, ctx.model) + 1,
                self.gate.scheduler.service_rate(now),
            )
        )
        return self.gate.refusal(
            "scheduler", Prio(ctx.priority), message, retry, None, ctx.request_id
        )

    # ---- dispatch ------------------------------------------------------------------------
    def slot_freed(self) -> None:
        """A backend slot or a reservation was given back (by a lease): queued requests
        may go now."""
        if self.core.queued:
            self.pump()

    def pump(self) -> None:
        """Dispatch whatever the batcher says is due, then arm the timer for the next."""
        core = self.core
        placement = self.placement
        now = placement.now = self.clock()
        placement.nagle_at = math.inf
        while True:
            batches = core.dispatch(now, placement.bind)
            if not batches:
                break
            for batch in batches:
                ch = self._children[batch.prio]
                ch.size.observe(batch.size)
                child = ch.reasons.get(batch.reason)
                if child is None:
                    child = ch.reasons[batch.reason] = self.metrics.batch_dispatches.labels(
                        BUCKETS[batch.prio], batch.reason
                    )
                child.inc()
                for unit in batch.units:
                    for it in unit:
                        ch.wait.observe(now - it.enqueued_at)
                    backend = unit[0].handle.backend
                    if len(unit) == 1 or backend is None:
                        for it in unit:
                            self._deliver(it.handle, backend)
                    else:
                        for it in unit:
                            it.handle.dispatched()
                        # the group's reservation and window place move from its head's
                        # lease to the merged request's, now (its head may leave meanwhile)
                        head = unit[0].handle.ctx.lease
                        holds = (head.hand_over(Hold.RESERVATION), head.hand_over(Hold.MERGE_SLOT))
                        task = asyncio.get_running_loop().create_task(
                            self.merged.run(unit, backend, holds)
                        )
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
        self._arm(now)

    def _arm(self, now: float) -> None:
        at = self.core.next_due_at()
        if self.core.blocked:  # a backend may become routable without any slot freeing
            at = min(at if at is not None else math.inf, now + 0.05, self.placement.nagle_at)
        if at is None or at == math.inf or at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self.pump()

    def _deliver(self, w: Waiter, result: Any) -> None:
        if not w.fut.done():
            w.fut.set_result(result)
            return
        # its request left meanwhile: what was kept for it goes back now (inside the pump:
        # the queue is woken on the next turn of the loop)
        lease = w.ctx.lease
        freed = False
        for what in (Hold.RESERVATION, Hold.MERGE_SLOT):
            release = lease.hand_over(what)
            if release is not None:
                release()
                freed = True
        if freed:
            asyncio.get_running_loop().call_soon(self.slot_freed)

    async def close(self) -> None:
        """Stop the timer and any merged request still running (shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _length_of(queue: Sized) -> Callable[[], float]:
    """A gauge callback reading ``len(queue)``."""
    return lambda: len(queue)
