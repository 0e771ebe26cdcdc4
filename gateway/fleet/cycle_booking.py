"""Booking a maintenance cycle: its lease, its place on the cycle clock, its run as the
backend's one procedure (:class:`gateway.fleet.procedures.Procedures`). The entry points
besides the lifecycle loop's scheduled cycles (:meth:`CycleBooking.start`): a cooldown asked
for by the admin API or a thermal trigger (:meth:`~CycleBooking.request_cooldown`), a cycle
taken over from a replica that stopped renewing its lease (:meth:`~CycleBooking.take_over`),
and the restart after a GPU fault (:meth:`~CycleBooking.gpu_fault`).

Each cycle runs under a maintenance lease (:mod:`gateway.fleet.leases`) taken before it
changes anything and given back when it ends. One gateway's leases
(:class:`~gateway.fleet.leases.LocalLeases`) are granted at once; in fleet mode
(:meth:`gateway.fleet.maintenance.Maintenance.use_leases`) the lease is taken in the shared
store, so one replica runs each backend's cycle for the whole fleet, the drain waits for
every replica's requests, and a replica taking over a dead holder's lease finishes the cycle
from the step it reached. A cycle cancelled by the gateway's stop keeps its lease until it
expires, so another replica finishes it. The steps themselves:
:class:`gateway.fleet.cycle_steps.CycleSteps`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend
from gateway.fleet.cycle_steps import CycleSteps, RestDone
from gateway.fleet.cycles import CycleKind, cycle_started
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.fleet.leases import (
    LeasePhase,
    LocalLeases,
    MaintenanceLease,
    MaintenanceLeases,
    takes_out,
)
from gateway.fleet.procedures import Procedures
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")


class CycleBooking:
    """Books and runs the cycles of ``fleet`` under ``cfg``: ``steps`` does them, under leases
    from ``leases`` (:meth:`gateway.fleet.maintenance.Maintenance.use_leases` replaces them
    in fleet mode); ``rollouts``: the running rollouts' versions
    (:func:`gateway.fleet.lifecycle.may_take_out`); ``scheduled_rest``: the end condition of
    a scheduled medium cycle's rest (None: the fixed ``lifecycle.medium.cooldown_s``);
    ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        state: FleetState,
        procedures: Procedures,
        drains: Drains,
        metrics: GatewayMetrics,
        steps: CycleSteps,
        rollouts: Callable[[], lifecycle.RolloutVersions],
        scheduled_rest: Callable[[Backend], RestDone | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.state = state
        self.procedures = procedures
        self.drains = drains
        self.metrics = metrics
        self.steps = steps
        self.rollouts = rollouts
        self.scheduled_rest = scheduled_rest
        self.clock = clock
        self.leases: MaintenanceLeases = LocalLeases()

    def start(self, b: Backend, kind: CycleKind, lease: MaintenanceLease, now: float) -> None:
        """Start ``b``'s scheduled ``kind`` cycle under ``lease`` at monotonic ``now``: booked
        on its cycle clock, counted, and (medium, long) out of rotation (``draining``) here,
        synchronously, so the next backend's stagger check already counts it out."""
        cycle_started(b.cycles, kind, now, b.requests_served, self.cfg.lifecycle)
        self.metrics.cycles.labels(b.id, kind.value).inc()
        if kind is CycleKind.SHORT:
            self.run(b, "short", lease, self.steps.short_cycle(b))
        elif kind is CycleKind.MEDIUM:
            self.state.transition(b, S.DRAINING, "cooldown_scheduled")
            self.run(
                b,
                "medium",
                lease,
                self.steps.medium_cycle(
                    b, "scheduled", rest_done=self.scheduled_rest(b), lease=lease
                ),
            )
        else:
            self.state.transition(b, S.DRAINING, "restart_scheduled")
            self.run(b, "long", lease, self.steps.long_cycle(b, "scheduled", lease))

    async def acquire(
        self, b: Backend, kind: CycleKind, reason: str, force: bool = False
    ) -> MaintenanceLease | None:
        """The lease for ``kind`` on ``b`` (None: refused). With shared leases the store is
        asked, so the loop may have moved meanwhile: a lease on a backend that is no longer
        warm and free is given back at once."""
        deadline = (
            self.clock() + self.cfg.lifecycle.drain_deadline_s if takes_out(kind) else None
        )
        lease = await self.leases.acquire(b, kind, reason, deadline, force)
        if lease is not None and (self.procedures.busy(b) or b.state is not S.WARM):
            await self.leases.release(lease)
            return None
        return lease

    def run(
        self,
        b: Backend,
        name: str,
        lease: MaintenanceLease,
        cycle: Coroutine[Any, Any, None],
    ) -> asyncio.Task[None]:
        """Run ``cycle`` as ``b``'s procedure under ``lease``, given back when it ends (not
        when the gateway's stop cancels it: then it expires and another replica finishes
        the cycle)."""

        async def leased() -> None:
            try:
                await cycle
            except asyncio.CancelledError:
                raise
            except BaseException:
                await self.leases.release(lease)
                raise
            await self.leases.release(lease)

        return self.procedures.run(b, name, leased())

    async def take_over(self, backend: Backend, lease: MaintenanceLease) -> None:
        """Finish the cycle of a lease this replica took over from a holder that stopped
        renewing it (fleet mode), from the step it reached: a medium cycle drains if it
        was draining, resets the prefix cache unless done, rests out the rest it was given
        (the fixed rest when it had none), wakes vLLM if it slept, calibrates and returns the
        backend; a long cycle drains and runs the restart hook unless it is already
        restarting; a short one just ends."""
        await self.procedures.cancel_and_wait(backend)  # the follower's drain, if any
        if lease.cycle is CycleKind.MEDIUM:
            cycle = self.steps.medium_cycle(backend, lease.reason, lease=lease)
        elif lease.cycle is CycleKind.LONG and lease.phase is not LeasePhase.RESTARTING:
            cycle = self.steps.long_cycle(backend, lease.reason, lease)
        else:
            cycle = _done()
        self.run(backend, lease.cycle.value, lease, cycle)

    def request_cooldown(
        self,
        backend_id: str,
        reason: str,
        min_rest_s: float = 0.0,
        force: bool = False,
        rest_done: RestDone | None = None,
    ) -> bool:
        """Run the medium cycle on a backend now: the entry point for the admin API and for
        thermal triggers. Respects staggering (``max_unavailable``, never the last warm
        backend of a model) unless ``force``. ``rest_done`` replaces the fixed rest (see
        :meth:`~gateway.fleet.cycle_steps.CycleSteps.medium_cycle`). Returns whether the
        cycle started."""
        backend = self.fleet.get(backend_id)
        if backend is None or self.procedures.busy(backend) or backend.state is not S.WARM:
            return False
        if not force and not lifecycle.may_take_out(
            backend, self.fleet.backends, self.cfg.lifecycle, self.rollouts()
        ):
            return False
        if self.leases.shared:  # the lease first (a store call): the cycle starts once granted
            self.procedures.run(
                backend,
                "medium",
                self._leased_cooldown(backend, reason, min_rest_s, force, rest_done),
            )
            return True
        lease = MaintenanceLease(
            backend.id, CycleKind.MEDIUM, reason, LeasePhase.DRAINING
        )  # one gateway: granted
        self._booked_cooldown(backend, reason)
        cycle = self.steps.medium_cycle(backend, reason, min_rest_s, rest_done, lease)
        self.procedures.run(backend, "medium", cycle)
        return True

    def _booked_cooldown(self, backend: Backend, reason: str) -> None:
        lc = self.cfg.lifecycle
        cycle_started(backend.cycles, CycleKind.MEDIUM, self.clock(), backend.requests_served, lc)
        self.metrics.cycles.labels(backend.id, "medium").inc()
        # out of rotation now: the stagger check of the next backend counts it
        self.state.transition(backend, S.DRAINING, f"cooldown_{reason}")

    async def _leased_cooldown(
        self,
        backend: Backend,
        reason: str,
        min_rest_s: float,
        force: bool,
        rest_done: RestDone | None,
    ) -> None:
        """:meth:`request_cooldown` in fleet mode: the lease, then the cycle (as the same
        procedure); refused (another replica's lease, staggering across replicas, the store
        down): nothing happens."""
        lc = self.cfg.lifecycle
        deadline = self.clock() + lc.drain_deadline_s
        lease = await self.leases.acquire(backend, CycleKind.MEDIUM, reason, deadline, force)
        if lease is None:
            log.info("backend %s: %s cooldown not started: lease refused", backend.id, reason)
            return
        if backend.state is not S.WARM:
            await self.leases.release(lease)
            return
        try:
            self._booked_cooldown(backend, reason)
            await self.steps.medium_cycle(backend, reason, min_rest_s, rest_done, lease)
        except asyncio.CancelledError:
            raise  # the gateway stops: the lease expires and another replica finishes
        except BaseException:
            await self.leases.release(lease)
            raise
        await self.leases.release(lease)

    # ---- GPU faults ------------------------------------------------------------------------
    def gpu_fault(self, backend: Backend, reason: str) -> None:
        """A new Xid burst or ECC DBE on ``backend``'s GPUs (``reason``: ``gpu_xid`` /
        ``gpu_ecc``): ``unhealthy`` now, held out (``gpu_fault``) until the restart is seen
        or an operator undrains it, and the restart hook runs; after a successful hook the
        hold is ``restarting`` (as after the long cycle's). In fleet mode the hook runs on
        the one replica that claims the restart and both holds are every replica's
        (:class:`gateway.fleet.sharing.SharedHolds`, through :class:`Drains`)."""
        self.drains.hold_for_gpu_fault(backend, reason)
        self.procedures.run(backend, "gpu_restart", self.steps.gpu_restart(backend, reason))


async def _done() -> None:
    """A cycle with nothing left to do (a short cycle taken over, a restart already under
    way)."""
