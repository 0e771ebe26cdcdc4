"""Affinity agrees across replicas (issue 14, item 6): the Responses API's response ids.

Sessions need no store: fleet mode routes them by rendezvous hashing
(:mod:`gateway.routing.rendezvous`), which every replica computes alike. A response id is
different: only the backend that created it holds it, and only the replica that relayed the
answer saw which one. :class:`SharedResponses` is the fleet's
:class:`gateway.flow.responses.ResponseDirectory`:

- **publish** (from ``ResponseRouting.learn`` / ``found``, on the request path): a
  background task (kept in a set, cancelled at stop) writes ``aff:resp:<id>`` =
  ``<backend>|<learned at, store clock>|<model>`` with the table's TTL
  (``routing.responses_ttl_s``). Nothing waits for it; while the store is down it is skipped
  (the id is still in this replica's table, and written back at resync).
- **lookup** (``ResponseRouting.recall``): one ``GET`` for an id this replica does not know,
  on a follow-up or by-id call: bounded by ``coordination.op_timeout_s`` and skipped at once
  while the store is down (then the one-process rules apply: a follow-up is routed like any
  request, a by-id call asks each backend in turn).
- **resync** (the store answers again, maybe empty after a restart): every id this
  replica's table still holds is written again with the TTL it has left (one pipeline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.metrics import GatewayMetrics
from gateway.routing.response_owners import ResponseOwners

log = logging.getLogger("gateway.coord")


class SharedResponses:
    """Response id -> backend in the shared store. ``owners``: this replica's table (what
    resync writes back); ``ttl_s``: ``routing.responses_ttl_s``; ``clock``: the table's
    (monotonic seconds)."""

    def __init__(
        self,
        link: RedisLink,
        metrics: GatewayMetrics,
        owners: ResponseOwners,
        ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.link = link
        self.metrics = metrics
        self.owners = owners
        self.ttl_s = ttl_s
        self.clock = clock
        self.tasks: set[asyncio.Task[None]] = set()

    def key(self, response_id: str) -> str:
        return self.link.key("aff", "resp", response_id)

    def publish(self, response_id: str, backend_id: str, model: str) -> None:
        """Write the id in the background (skipped while the store is down)."""
        if self.link.fallback:
            return
        value = f"{backend_id}|{self.link.now():.3f}|{model}"
        ttl_ms = max(1, int(self.ttl_s * 1000))
        task = asyncio.get_running_loop().create_task(
            self._write("response_publish", [(self.key(response_id), value, ttl_ms)])
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _write(self, op: str, items: list[tuple[str, str, int]]) -> None:
        async def write(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for k, v, ttl_ms in items:
                pipe.set(k, v, px=ttl_ms)
            await pipe.execute()

        try:
            await self.link.call(op, write)
        except CoordinationUnavailable:
            pass  # in the table here; written back at resync

    async def lookup(self, response_id: str) -> tuple[str, str, float] | None:
        """``(backend id, model, seconds since learned)`` or None (unknown, or the store
        did not answer within ``op_timeout_s``: counted, and the caller goes on without)."""
        try:
            raw = await self.link.call(
                "response_lookup", lambda c: c.get(self.key(response_id))
            )
        except CoordinationUnavailable:
            self.metrics.response_lookups.labels("unavailable").inc()
            return None
        if not raw:
            self.metrics.response_lookups.labels("unknown").inc()
            return None
        try:
            backend_id, at, model = str(raw).split("|", 2)
            age_s = max(0.0, self.link.now() - float(at))
        except ValueError:
            self.metrics.response_lookups.labels("unknown").inc()
            return None
        self.metrics.response_lookups.labels("found").inc()
        return backend_id, model, age_s

    async def resync(self) -> None:
        """Write back every id this replica's table still holds, with its TTL left."""
        now, store_now = self.clock(), self.link.now()
        items = []
        for rid, o in self.owners.live():
            left_s = o.learned_at + self.ttl_s - now
            if left_s > 0:
                at = store_now - (now - o.learned_at)
                items.append((self.key(rid), f"{o.backend_id}|{at:.3f}|{o.model}",
                              max(1, int(left_s * 1000))))
        if items:
            await self._write("response_resync", items)

    async def stop(self) -> None:
        """Cancel the writes still under way."""
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
