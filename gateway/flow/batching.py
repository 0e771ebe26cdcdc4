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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig
from gateway.core.outcomes import Refusal, shutting_down
from gateway.core.vocab import Prio
from gateway.fleet.backend import Backend, Fleet
from gateway.flow import merging
from gateway.flow.admission import AdmissionGate, Evicted, ShuttingDown
from gateway.flow.candidates import candidates
from gateway.flow.context import Answer, RequestContext
from gateway.flow.lease import BreakerSignals, Hold, RequestLease
from gateway.flow.merged import UNMERGED, MergedRequests, Waiter, has_result
from gateway.flow.pipeline import Pipeline
from gateway.metrics import GatewayMetrics
from gateway.routing.policies import Policy
from gateway.traffic.admission import retry_after_s
from gateway.traffic.batcher import (
    BUCKETS,
    Batcher,
    BucketSettings,
    Item,
    merge_window_limit,
)

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
        signals: BreakerSignals,
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
        self.merged = MergedRequests(
            pipeline, metrics, self.new_lease, self._reserve, self._deliver
        )
        self.router = router
        self.gate = gate
        self.metrics = metrics
        self.clock = clock
        self.queue_timeout_s = cfg.admission.max_queue_wait_s
        self._per_seq = b.in_flight_per_seq
        self._default_cap = b.default_capacity
        self.pending: dict[str, int] = {}  # bound at dispatch, attempt not started yet
        # merge window: embeddings upstream requests in flight per (backend id, merge key)
        self.merge_flight: dict[Hashable, int] = {}
        # backend id -> the request it is kept for: a request that needs several places
        # (prompts x n) and found none with room for its wait budget; nothing of its
        # priority or lower is bound there until it is placed or gone, so the backend
        # drains to fit it (EASY backfilling's reservation, Lifka 1995). Without it, the
        # single-place requests behind it took every freed place and it starved.
        self.kept_for: dict[str, Waiter] = {}
        self.shut = False  # shutting down: nothing more is queued or dispatched
        self._merge_window = b.merge_window
        self._now = 0.0  # the pump's clock reading, for _bind
        self._nagle_at = math.inf  # when a held group ripens (its wait budget ends)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._tasks: set[asyncio.Task[None]] = set()
        self._children = [
            _Children(metrics.batch_size.labels(n), metrics.batch_wait.labels(n)) for n in BUCKETS
        ]
        for prio, name in enumerate(BUCKETS):
            metrics.queue_depth.labels(name).set_function(
                lambda q=self.core.queues[prio]: len(q)
            )

    # ---- the request's side ----------------------------------------------------------
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
            return got  # type: ignore[no-any-return]

    async def _wait_once(self, ctx: RequestContext) -> Any:
        core = self.core
        prio = ctx.priority
        now = self.clock()
        if self.shut:  # (a merged request's member, sent back to be sent alone)
            raise self._shutting_down(ctx)
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
                raise self._shutting_down(ctx) from None
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

    @staticmethod
    def _shutting_down(ctx: RequestContext) -> Refusal:
        r = shutting_down()
        r.headers.extend(_str_headers(ctx.extra_headers))
        return r

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
        r = self.gate.refusal("scheduler", Prio(ctx.priority), message, retry, None, ctx.request_id)
        r.headers.extend(_str_headers(ctx.extra_headers))
        return r

    # ---- dispatch ------------------------------------------------------------------------
    def slot_freed(self) -> None:
        """A backend slot or a reservation was given back (by a lease): queued requests
        may go now."""
        if self.core.queued:
            self.pump()

    # ---- merge window -------------------------------------------------------------------
    def _full(self, prio: int) -> int:
        """Size of a full merge group of bucket ``prio`` (requests)."""
        return min(self.core.settings[prio].max_batch_size, self.core.merge_max)

    def _merge_release_slot(self, slot: Hashable) -> None:
        """An upstream request counted in ``slot``'s merge window ended (its lease)."""
        left = self.merge_flight.get(slot, 0) - 1
        if left > 0:
            self.merge_flight[slot] = left
        else:
            self.merge_flight.pop(slot, None)

    def pump(self) -> None:
        """Dispatch whatever the batcher says is due, then arm the timer for the next."""
        core = self.core
        now = self._now = self.clock()
        self._nagle_at = math.inf
        while True:
            batches = core.dispatch(now, self._bind)
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
            at = min(at if at is not None else math.inf, now + 0.05, self._nagle_at)
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

    def _limit(self, b: Backend) -> float:
        """Places on ``b`` (sequences; ``inf`` without a known capacity)."""
        cap = b.capacity or self._default_cap
        if cap is None:
            return math.inf
        return max(1, math.ceil(cap * self._per_seq))

    def _room(self, b: Backend) -> float:
        """Places left on ``b`` (sequences; ``inf`` without a known capacity)."""
        return self._limit(b) - b.in_flight - self.pending.get(b.id, 0)

    def _fits(self, b: Backend, need: int) -> bool:
        """Whether ``need`` places fit on ``b`` (an idle backend takes even a request larger
        than its capacity: it would never fit otherwise)."""
        room = self._room(b)
        return room >= need or (room >= 1 and room >= self._limit(b))

    def _bind(self, unit: list[Item]) -> int:
        """Reserve places on a backend with room for ``unit`` (a single request, or a merge
        group sent as one upstream request): a request takes its ``places`` (sequences it
        decodes: prompts x n), an embeddings request one, merged or not (its inputs are
        prefill-only sequences of one engine step), and embeddings also take a place in
        the backend's merge window of their merge key. A completions merge group is placed
        as far as its members' prompts fit. Returns how many requests it placed."""
        w: Waiter = unit[0].handle
        ctx = w.ctx
        cands = candidates(self.fleet, ctx.model, (), self._now)
        if not cands:  # nothing can take the model at all: the pipeline answers 429/503
            w.backend = None
            return len(unit)
        key = unit[0].merge_key
        endpoint = merging.key_endpoint(key)
        windowed = endpoint == merging.EMBEDDINGS and self._merge_window > 0
        # Nagle: a backend with nothing of this key's window in flight takes any group at
        # once; one with some in flight (below the window) a full group, or one whose
        # oldest request has waited its wait budget
        limit = 1
        ripe_at = math.inf
        if windowed:
            first = unit[0]
            budget = self.core.wait_budget(first.prio)
            ripe_at = first.enqueued_at + budget
            limit = merge_window_limit(
                len(unit),
                self._full(first.prio),
                self._now - first.enqueued_at,
                budget,
                self._merge_window,
            )
        flight = self.merge_flight
        need = 1 if endpoint == merging.EMBEDDINGS else ctx.places
        prio = unit[0].prio
        open_ = [c for c in cands if self._open_to(c, w, prio)]
        b = self.router.pick(
            [
                c
                for c in open_
                if self._fits(c, need) and (not windowed or flight.get((c.id, key), 0) < limit)
            ],
            ctx.session_key,
        )
        if b is None:
            if windowed and limit == 1:  # wake when it ripens
                self._nagle_at = min(self._nagle_at, ripe_at)
            if need > 1:
                self._keep_backend(unit[0], open_)
            return 0
        if w.reserved is not None:  # placed: its kept backend is free again
            if self.kept_for.get(w.reserved) is w:
                del self.kept_for[w.reserved]
            w.reserved = None
        took, places = len(unit), 1
        if endpoint != merging.EMBEDDINGS:
            room = max(self._room(b), need)  # an idle backend takes the first one anyway
            took = places = 0
            for it in unit:
                p = it.handle.ctx.places
                if took and places + p > room:
                    break
                took += 1
                places += p
        self._reserve(b, places, ctx.lease)
        w.backend = b
        if windowed:  # one upstream request in b's window until its lease gives it back
            slot = (b.id, key)
            flight[slot] = flight.get(slot, 0) + 1
            ctx.lease.hold(Hold.MERGE_SLOT, lambda: self._merge_release_slot(slot))
        return took

    def _open_to(self, b: Backend, w: Waiter, prio: int) -> bool:
        """Whether ``b`` may take ``w``'s request (of bucket ``prio``): it is not kept for
        another queued request of the same or a more urgent bucket."""
        kept = self.kept_for.get(b.id)
        if kept is None or kept is w:
            return True
        if kept.fut.done() or kept.riding:  # placed, timed out, evicted or gone
            del self.kept_for[b.id]
            kept.reserved = None
            return True
        return prio < kept.ctx.priority

    def _keep_backend(self, head: Item, cands: list[Backend]) -> None:
        """``head`` needs several places and none of ``cands`` has them: once it has waited
        its wait budget, keep the candidate with the most room for it (one per request)."""
        w: Waiter = head.handle
        if w.reserved is not None or self._now - head.enqueued_at < self.core.wait_budget(
            head.prio
        ):
            return
        free = [c for c in cands if c.id not in self.kept_for]
        if free:
            b = max(free, key=self._room)
            self.kept_for[b.id] = w
            w.reserved = b.id

    def _reserve(self, b: Backend, places: int, lease: RequestLease) -> None:
        """Keep ``places`` on ``b`` for a dispatched request until its attempt starts
        there (the lease gives them back then, or when the request ends first)."""
        self.pending[b.id] = self.pending.get(b.id, 0) + places
        lease.hold(Hold.RESERVATION, lambda: self._unreserve(b, places))

    def _unreserve(self, b: Backend, n: int = 1) -> None:
        left = self.pending.get(b.id, 0) - n
        if left > 0:
            self.pending[b.id] = left
        else:
            self.pending.pop(b.id, None)

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


def _str_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
