"""The fleet-mode parts of one replica and their sync round.

:class:`Coordination` is built by :func:`gateway.wiring.build_gateway` when
``coordination.redis_url`` is set. It owns the link (:class:`gateway.coord.link.RedisLink`)
and the parts that share state through it, each registered for the sync round with
:meth:`Coordination.add_sync`. The round runs every ``coordination.sync_interval_s`` as the
``coordination`` control loop: the link's probe (reconnect, store clock), then each part's
sync in order; a part whose store call fails ends the round (the link is down; the next
rounds only probe until it answers, and the resync callbacks then write state back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.config import GatewayConfig
from gateway.coord.config_sync import FleetConfig
from gateway.coord.leases import FleetLeases
from gateway.coord.link import CoordinationUnavailable, RedisLink, default_replica_id
from gateway.coord.operator import OperatorActions
from gateway.coord.replicas import Replicas
from gateway.fleet.controller import FleetController
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

SyncBody = Callable[[], Awaitable[None]]


class Coordination:
    """Fleet mode for one replica of ``cfg`` (``cfg.coordination.redis_url`` set).

    ``replica_id``: this replica's name (default ``coordination.replica_id``, else
    :func:`gateway.coord.link.default_replica_id`)."""

    def __init__(
        self,
        cfg: GatewayConfig,
        metrics: GatewayMetrics,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        c = cfg.coordination
        self.cfg = cfg
        self.clock = clock
        self.started_at = clock()  # monotonic seconds (the readiness grace counts from it)
        self.metrics = metrics
        self.replica_id = replica_id or c.replica_id or default_replica_id()
        self.link = RedisLink(c, metrics, self.replica_id)
        fleet = {
            "backends": {b.id: str(b.url) for b in cfg.backends},
            "max_unavailable": cfg.lifecycle.max_unavailable,
        }
        self.replicas = Replicas(
            self.link, metrics, f"{cfg.server.host}:{cfg.server.port}", fleet
        )
        self._syncs: list[tuple[str, SyncBody]] = [("heartbeat", self.replicas.heartbeat)]
        # first of the resyncs: a replica whose id another live process holds writes nothing
        self.link.on_resync(self.replicas.heartbeat)
        self._stops: list[SyncBody] = []
        self._fallbacks: list[tuple[str, SyncBody]] = []
        self.operator: OperatorActions | None = None  # share_operator_actions
        self.config: FleetConfig | None = None  # share_config
        # maintenance leases (bound to the fleet controller by wiring: leases.bind)
        self.leases = FleetLeases(self.link, self.replicas, metrics, cfg)
        self.add_part(
            "leases", self.leases.sync, self.leases.resync, fallback=self.leases.fallback
        )

    def share_operator_actions(self, controller: FleetController) -> OperatorActions:
        """Fleet-wide operator actions and verdicts on ``controller``'s backends
        (:mod:`gateway.coord.operator`): its sync step, its resync, and the seams of the
        drains and the calibrator."""
        ops = OperatorActions(self.cfg.coordination, self.link, controller, self.metrics)
        self.operator = ops
        self.add_part("operator", ops.sync, ops.resync, ops.stop)
        controller.share_verdicts(ops, ops)
        return ops

    def share_config(self) -> FleetConfig:
        """The fleet's config in the store (:mod:`gateway.coord.config_sync`), synced every
        round after the parts added before it; bound to the reloader by the app."""
        fc = FleetConfig(self.link, self.replicas, self.metrics, self.cfg.reload.keep)
        self.config = fc
        self.add_part("config", fc.sync)
        return fc

    def add_part(
        self,
        name: str,
        sync: SyncBody | None = None,
        resync: SyncBody | None = None,
        stop: SyncBody | None = None,
        fallback: SyncBody | None = None,
    ) -> None:
        """Register a fleet-mode part's hooks, in the order parts are added: ``sync``
        (:meth:`add_sync`), ``resync`` (:meth:`gateway.coord.link.RedisLink.on_resync`),
        ``stop`` (:meth:`add_stop`) and ``fallback`` (:meth:`add_fallback`)."""
        if sync is not None:
            self.add_sync(name, sync)
        if fallback is not None:
            self.add_fallback(name, fallback)
        if resync is not None:
            self.link.on_resync(resync)
        if stop is not None:
            self.add_stop(stop)

    def add_sync(self, name: str, body: SyncBody) -> None:
        """Run ``body`` in every sync round, after the parts added before it. It may raise
        :class:`CoordinationUnavailable` (ends the round)."""
        self._syncs.append((name, body))

    def add_stop(self, body: SyncBody) -> None:
        """Run ``body`` at :meth:`stop`, before leaving the replica list: a part gives back
        what it holds (best effort while the store answers) and ends its tasks. Its failures
        are logged, never raised."""
        self._stops.append(body)

    def add_fallback(self, name: str, body: SyncBody) -> None:
        """Run ``body`` in every round in which the store does not answer (the part's
        local share: e.g. followers returning backends whose last seen lease ran out)."""
        self._fallbacks.append((name, body))

    async def sync_round(self) -> None:
        """One round: probe the link, then each part's sync while the store answers (each
        part's fallback when it does not)."""
        if not await self.link.probe():
            for _name, body in self._fallbacks:
                await body()
            return
        for _name, body in self._syncs:
            try:
                await body()
            except CoordinationUnavailable:
                return

    async def connect(self) -> None:
        """Before the control loops start: one sync round, bounded (a store that does not
        answer leaves the replica in fallback; it keeps trying)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, self.cfg.coordination.op_timeout_s * 8)):
                await self.sync_round()
        if self.link.fallback:
            log.warning(
                "replica %s starts without the shared store (%s); retrying every %g s",
                self.replica_id, self.link.reason, self.cfg.coordination.retry_interval_s,
            )

    def readiness(self) -> tuple[bool, str]:
        """The ``coordination`` readiness check (:mod:`gateway.core.readiness`): ready once
        the shared store has answered this replica since it started, whatever it does after.

        A store outage after that never makes the replica not ready: requests still flow on
        the local share (issue 14), and every replica would leave its load balancer at once.
        A replica that has never reached the store is not ready for up to
        ``coordination.ready_grace_s`` (30 s): it knows neither how many replicas share the
        rate limits (its local share would be the whole limit) nor the fleet's maintenance
        and operator records, so it waits (``connect`` and then the ``coordination`` loop
        retry every ``retry_interval_s``). After the grace it is ready on its local share,
        as a replica is during an outage: otherwise a Redis outage during a rolling restart
        (or a whole fleet's) would leave no replica ready and fail every request a backend
        could serve. ``ready_grace_s: null`` waits for the store however long it takes."""
        link = self.link
        if not link.answered_once:
            grace = self.cfg.coordination.ready_grace_s
            waited = self.clock() - self.started_at
            if grace is None or waited < grace:
                return False, f"the shared store has not answered since start: {link.reason}"
            return True, (
                f"the shared store has not answered in {waited:.0f} s (ready_grace_s "
                f"{grace:g} s): running on the local share: {link.reason}"
            )
        if link.up:
            return True, "the shared store answers"
        return True, f"running on the local share: {link.reason}"

    def start_loops(self, controller: FleetController) -> None:
        """Add the ``coordination`` loop (every ``coordination.sync_interval_s``)."""
        controller.add_loop("coordination", self.cfg.coordination.sync_interval_s, self.sync_round)

    async def stop(self) -> None:
        """Each part's stop, then leave the replica list (best effort); close the link."""
        for body in self._stops:
            try:
                await body()
            except Exception:
                log.exception("a coordination part failed to stop")
        if self.link.up:
            await self.replicas.leave()
        await self.link.close()
