"""Placement: which backend a dispatched request (or merge group) goes to, and what is kept
for it there until its attempt starts.

The pure batcher (:class:`gateway.traffic.batcher.Batcher`) decides what is due; its
dispatch calls :meth:`Placement.bind` for each unit. A backend takes a unit when it has
room for its places (sequences: prompts x n; an embeddings request takes one) counting the
places reserved for requests already bound but not yet started (:attr:`Placement.pending`,
held on each request's lease), and, for embeddings, when its merge window of the unit's key
allows (Nagle's algorithm, RFC 896; see :mod:`gateway.flow.batching`). A request needing
several places that found none for its wait budget gets a backend kept for it (EASY
backfilling's reservation, Lifka 1995).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TypeVar

from gateway.config import BatcherConfig
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.flow import merging
from gateway.flow.candidates import candidates
from gateway.flow.lease import Hold, RequestLease
from gateway.flow.merged import Waiter
from gateway.routing.policies import Policy
from gateway.traffic.batcher import Batcher, Item, merge_window_limit
from gateway.traffic.breaker import BreakerState

K = TypeVar("K", bound=Hashable)


class Placement:
    """The dispatch's placement state and policy (one per batch dispatcher). ``now`` is
    the pump's clock reading (monotonic seconds), set before each dispatch; ``nagle_at``
    the earliest time a held merge group ripens (the pump's timer)."""

    def __init__(self, b: BatcherConfig, core: Batcher, fleet: Fleet, router: Policy) -> None:
        self.core = core
        self.fleet = fleet
        self.router = router
        self.per_seq = b.in_flight_per_seq
        self.default_cap = b.default_capacity
        self.merge_window = b.merge_window
        self.pending: dict[str, int] = {}  # bound at dispatch, attempt not started yet
        # of those, the ones bound while the backend's breaker was half-open: each will be
        # a probe, so together with the probes in flight they stay within half_open_max
        self.pending_probes: dict[str, int] = {}
        # merge window: embeddings upstream requests in flight per (backend id, merge key)
        self.merge_flight: dict[Hashable, int] = {}
        # backend id -> the request it is kept for: a request that needs several places
        # (prompts x n) and found none with room for its wait budget; nothing of its
        # priority or lower is bound there until it is placed or gone, so the backend
        # drains to fit it (EASY backfilling's reservation, Lifka 1995). Without it, the
        # single-place requests behind it took every freed place and it starved.
        self.kept_for: dict[str, Waiter] = {}
        self.now = 0.0
        self.nagle_at = math.inf
        # fleet mode: backend id -> this replica's share of its places (set_shares)
        self.shares: dict[str, int] | None = None

    def full(self, prio: int) -> int:
        """Size of a full merge group of bucket ``prio`` (requests)."""
        return min(self.core.settings[prio].max_batch_size, self.core.merge_max)

    def merge_release_slot(self, slot: Hashable) -> None:
        """An upstream request counted in ``slot``'s merge window ended (its lease)."""
        _decrement(self.merge_flight, slot)

    def limit(self, b: Backend) -> float:
        """Places on ``b`` (sequences; ``inf`` without a known capacity); in fleet mode this
        replica's share of them (:meth:`set_shares`)."""
        own = self.backend_limit(b)
        if self.shares is not None and b.id in self.shares:
            return min(own, self.shares[b.id])
        return own

    def backend_limit(self, b: Backend) -> float:
        """Places on ``b`` for one gateway: ``max_num_seqs x in_flight_per_seq``."""
        cap = b.capacity or self.default_cap
        if cap is None:
            return math.inf
        return max(1, math.ceil(cap * self.per_seq))

    def set_shares(self, shares: dict[str, int]) -> None:
        """Fleet mode: this replica's places per backend id (its share of
        :meth:`backend_limit`, ``gateway.coord.capacity``). Places already reserved or in
        flight above a lowered share are not taken back; no new one is bound there until
        the backend is below it."""
        self.shares = dict(shares)

    def room(self, b: Backend) -> float:
        """Places left on ``b`` (sequences; ``inf`` without a known capacity)."""
        return self.limit(b) - b.in_flight - self.pending.get(b.id, 0)

    def fits(self, b: Backend, need: int) -> bool:
        """Whether ``need`` places fit on ``b`` (an idle backend takes even a request larger
        than its capacity: it would never fit otherwise)."""
        room = self.room(b)
        return room >= need or (room >= 1 and room >= self.limit(b))

    def bind(self, unit: list[Item]) -> int:
        """Reserve places on a backend with room for ``unit`` (a single request, or a merge
        group sent as one upstream request): a request takes its ``places`` (sequences it
        decodes: prompts x n), an embeddings request one, merged or not (its inputs are
        prefill-only sequences of one engine step), and embeddings also take a place in
        the backend's merge window of their merge key. A completions merge group is placed
        as far as its members' prompts fit. Returns how many requests it placed."""
        w: Waiter = unit[0].handle
        ctx = w.ctx
        cands = candidates(self.fleet, ctx.model, (), self.now, ctx.version,
                           ctx.fallback_version)
        if ctx.pinned is not None:  # only its own backend (gateway.flow.responses)
            cands = [c for c in cands if c is ctx.pinned]
        if not cands:  # nothing can take the model at all: the pipeline answers 429/503
            w.backend = None
            return len(unit)
        key = unit[0].merge_key
        endpoint = merging.key_endpoint(key)
        windowed = endpoint == merging.EMBEDDINGS and self.merge_window > 0
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
                self.full(first.prio),
                self.now - first.enqueued_at,
                budget,
                self.merge_window,
            )
        flight = self.merge_flight
        need = 1 if endpoint == merging.EMBEDDINGS else ctx.places
        prio = unit[0].prio
        open_ = [c for c in cands if self.open_to(c, w, prio) and self.may_probe(c)]
        b = self.router.pick(
            [
                c
                for c in open_
                if self.fits(c, need) and (not windowed or flight.get((c.id, key), 0) < limit)
            ],
            ctx.session_key,
        )
        if b is None:
            if windowed and limit == 1:  # wake when it ripens
                self.nagle_at = min(self.nagle_at, ripe_at)
            if need > 1:
                self.keep_backend(unit[0], open_)
            return 0
        if w.reserved is not None:  # placed: its kept backend is free again
            if self.kept_for.get(w.reserved) is w:
                del self.kept_for[w.reserved]
            w.reserved = None
        took, places = len(unit), 1
        if endpoint != merging.EMBEDDINGS:
            room = max(self.room(b), need)  # an idle backend takes the first one anyway
            took = places = 0
            for it in unit:
                p = it.handle.ctx.places
                if took and places + p > room:
                    break
                took += 1
                places += p
        self.reserve(b, places, ctx.lease)
        w.backend = b
        if windowed:  # one upstream request in b's window until its lease gives it back
            slot = (b.id, key)
            flight[slot] = flight.get(slot, 0) + 1
            ctx.lease.hold(Hold.MERGE_SLOT, lambda: self.merge_release_slot(slot))
        return took

    def open_to(self, b: Backend, w: Waiter, prio: int) -> bool:
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

    def keep_backend(self, head: Item, cands: list[Backend]) -> None:
        """``head`` needs several places and none of ``cands`` has them: once it has waited
        its wait budget, keep the candidate with the most room for it (one per request)."""
        w: Waiter = head.handle
        if w.reserved is not None or self.now - head.enqueued_at < self.core.wait_budget(
            head.prio
        ):
            return
        free = [c for c in cands if c.id not in self.kept_for]
        if free:
            b = max(free, key=self.room)
            self.kept_for[b.id] = w
            w.reserved = b.id

    def may_probe(self, b: Backend) -> bool:
        """Whether one more request may be bound to ``b``: always, unless its breaker is
        half-open and its probe slots are taken by probes in flight or bound already."""
        br = b.breaker
        if br.current() is not BreakerState.HALF_OPEN:
            return True
        return br.half_open_in_flight + self.pending_probes.get(b.id, 0) < br.cfg.half_open_max

    def reserve(self, b: Backend, places: int, lease: RequestLease) -> None:
        """Keep ``places`` on ``b`` for a dispatched request until its attempt starts
        there (the lease gives them back then, or when the request ends first); bound
        while ``b``'s breaker is half-open, it also keeps one of its probe slots."""
        self.pending[b.id] = self.pending.get(b.id, 0) + places
        if b.breaker.current() is BreakerState.HALF_OPEN:
            self.pending_probes[b.id] = self.pending_probes.get(b.id, 0) + 1

            def release() -> None:
                self.unreserve(b, places)
                _decrement(self.pending_probes, b.id)

            lease.hold(Hold.RESERVATION, release)
        else:
            lease.hold(Hold.RESERVATION, lambda: self.unreserve(b, places))

    def unreserve(self, b: Backend, n: int = 1) -> None:
        """Give back ``n`` places reserved on ``b``."""
        _decrement(self.pending, b.id, n)


def _decrement(counts: dict[K, int], key: K, n: int = 1) -> None:
    """Lower ``counts[key]`` by ``n``, dropping the key at zero."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
