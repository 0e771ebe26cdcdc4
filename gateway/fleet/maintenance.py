"""Maintenance: the lifecycle loop that starts due cycles, and the fleet's one front for the
cycles, thermal and admin cooldowns, the stall probe and the response to a GPU fault.

Every ``lifecycle.check_interval_s`` (:meth:`Maintenance.lifecycle_round`): a warm
backend's latency fuse is evaluated; one with requests in flight and nothing back for
``health.stall_after_s`` gets a stall probe; then every cycle that is due starts, the most
overdue backends first, staggered per model (:func:`gateway.fleet.lifecycle.may_take_out`)
and, for those that take a backend out, deferred while the other backends could not carry
the load (:func:`gateway.fleet.lifecycle.can_carry_without`; skipped after
``lifecycle.max_defer_s``) or while a running rollout needs the backend
(:meth:`Maintenance.use_rollouts`). A backend back in service after an outage is not cycled
again within a period (:meth:`Maintenance.back_in_service`).

Its parts, one job each:

* :mod:`gateway.fleet.cycle_steps`: what each cycle (short, medium, long), the stall probe
  and the GPU-fault restart do to a backend, step by step, resumable from a lease record;
* :mod:`gateway.fleet.cycle_booking`: a cycle's lease (one replica runs each backend's
  cycle for the whole fleet in fleet mode: :meth:`Maintenance.use_leases`), its booking on
  the cycle clock and its run as the backend's one procedure; the admin / thermal cooldown,
  a lease taken over from a dead holder (:meth:`Maintenance.take_over`), a GPU fault;
* :mod:`gateway.fleet.deferral`: the demand a cycle must leave carried, and its deferrals.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.clients import ControlClients
from gateway.fleet.cycle_booking import CycleBooking
from gateway.fleet.cycle_steps import CycleSteps, RestDone
from gateway.fleet.cycles import (
    SPREAD_SLOTS,
    CycleKind,
    back_from_outage,
    came_back,
    due_cycle,
    spread_slot,
)
from gateway.fleet.deferral import Deferrals
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.fleet.hooks import BackendHooks
from gateway.fleet.leases import MaintenanceLease, MaintenanceLeases
from gateway.fleet.probes import ProbeEndpoints
from gateway.fleet.procedures import Procedures
from gateway.fleet.records import Transition
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

__all__ = ["Maintenance", "RestDone"]

S = BackendState


class Maintenance:
    """Maintenance of ``fleet`` under ``cfg``. ``scheduled_rest``: the end condition of a
    scheduled medium cycle's rest on a backend (None: the fixed
    ``lifecycle.medium.cooldown_s``), from GPU telemetry; ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        state: FleetState,
        procedures: Procedures,
        drains: Drains,
        clients: ControlClients,
        endpoints: ProbeEndpoints,
        calibrator: Calibrator,
        hooks: BackendHooks,
        metrics: GatewayMetrics,
        scheduled_rest: Callable[[Backend], RestDone | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.state = state
        self.procedures = procedures
        self.metrics = metrics
        self.clock = clock
        self._rollouts: Callable[[], lifecycle.RolloutVersions] | None = None
        self._stall: dict[str, asyncio.Task[None]] = {}  # the running stall probe of each
        self.steps = CycleSteps(
            cfg, state, drains, clients, endpoints, calibrator, hooks, metrics, clock
        )
        self.booking = CycleBooking(
            cfg, fleet, state, procedures, drains, metrics, self.steps,
            self.rollout_versions, scheduled_rest, clock,
        )
        self.deferrals = Deferrals(cfg, fleet, state, metrics)

    @property
    def leases(self) -> MaintenanceLeases:
        """Where its maintenance leases come from (:meth:`use_leases`)."""
        return self.booking.leases

    def use_leases(self, leases: MaintenanceLeases) -> None:
        """Take maintenance leases from ``leases`` (fleet mode: the shared store) instead of
        granting them locally."""
        self.booking.leases = leases  # taken and given back
        self.steps.leases = leases  # each step recorded, the lease's loss seen

    def use_forecast(self, forecast_rps: Callable[[str], float | None]) -> None:
        """Read ``forecast_rps`` (requests/s forecast for a model) before a cycle takes a
        backend out."""
        self.deferrals.use_forecast(forecast_rps)

    def use_rollouts(self, running: Callable[[], lifecycle.RolloutVersions]) -> None:
        """Ask ``running`` (owned by the rollouts, :meth:`gateway.flow.rollouts.Rollouts
        .running_versions`) which versions are under rollout before a cycle takes a backend
        out: the last routable backend of either is held (:func:`lifecycle.rollout_hold`)."""
        self._rollouts = running

    def rollout_versions(self) -> lifecycle.RolloutVersions:
        """The running rollouts' ``(baseline, canary)`` per model (empty without any)."""
        return {} if self._rollouts is None else self._rollouts()

    async def stop(self) -> None:
        """Cancel the running stall probes and wait for them to end."""
        tasks, self._stall = list(self._stall.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def forget(self, backend: Backend) -> None:
        """``backend`` left the fleet: cancel its stall probe (if running) and drop it."""
        task = self._stall.pop(backend.id, None)
        if task is not None:
            task.cancel()

    def back_in_service(self, backend: Backend, t: Transition) -> None:
        """A :class:`FleetState` listener: a backend warm again after an outage (a restart,
        a crash, a preemption: :func:`~gateway.fleet.cycles.back_from_outage`) was just
        started and warmed up, so no cycle is due within a full period of now
        (:func:`~gateway.fleet.cycles.came_back`, staggered by its slot)."""
        if t.to_state is S.WARM and back_from_outage(backend.history):
            came_back(backend.cycles, spread_slot(backend.id), SPREAD_SLOTS, self.clock(),
                      backend.requests_served, self.cfg.lifecycle)

    def _stalling(self, b: Backend) -> bool:
        task = self._stall.get(b.id)
        return task is not None and not task.done()

    async def lifecycle_round(self) -> None:
        """Start every cycle that is due and allowed (staggered per model).

        The most overdue backends go first, and a backend leaves rotation (``draining``)
        here, synchronously, so the next backend's stagger check already counts it out.
        """
        lc = self.cfg.lifecycle
        stall = self.cfg.health.stall_after_s
        for b in self.fleet:
            if b.state is S.WARM and b.breaker.evaluate():
                self.state.breaker_tripped(b)  # latency fuse: P99 TTFT over 5x the SLO
            if (
                b.state is S.WARM
                and b.in_flight > 0
                and self.clock() - max(b.last_answer_at, b.busy_since) > stall
                and not self._stalling(b)
            ):
                probe = self.steps.stall_probe(b)
                self._stall[b.id] = asyncio.get_running_loop().create_task(probe)
        now = self.clock()
        self.deferrals.left_rotation()
        due = [b for b in self.fleet if not self.procedures.busy(b) and b.state is S.WARM]
        due.sort(key=lambda b: min(b.cycles.next_long, b.cycles.next_medium, b.cycles.next_short))
        for b in due:
            kind = due_cycle(b.cycles, now, b.requests_served, lc)
            if kind is None:
                continue
            if kind is not CycleKind.SHORT:
                rollouts = self.rollout_versions()
                why = lifecycle.rollout_hold(b, self.fleet.backends, rollouts)
                if why is None:
                    if not lifecycle.may_take_out(b, self.fleet.backends, lc, rollouts):
                        continue  # staggered: it stays due and starts when allowed
                    why = lifecycle.can_carry_without(
                        b, self.fleet.backends, self.demand(), lc.carry_utilization,
                        now, self.cfg.telemetry.stale_after_s,
                    )
                if why is not None:
                    self.deferrals.defer(b, kind, why, now)
                    if now >= b.cycles.next_short:  # the engine probe is not held back
                        short = await self.booking.acquire(b, CycleKind.SHORT, "scheduled")
                        if short is not None:
                            self.booking.start(b, CycleKind.SHORT, short, now)
                    continue  # deferred: it stays due and starts at the next quiet moment
            lease = await self.booking.acquire(b, kind, "scheduled")
            if lease is None:
                continue  # another replica runs it, or staggering across replicas: still due
            self.deferrals.end(b, now)
            self.booking.start(b, kind, lease, now)

    # ---- the parts' entry points (the controller, the admin API, the tests) ---------------
    def demand(self) -> dict[str, float]:
        """Requests/s each model must be served at (:meth:`Deferrals.demand`)."""
        return self.deferrals.demand()

    async def take_over(self, backend: Backend, lease: MaintenanceLease) -> None:
        """Finish a cycle taken over from a replica that stopped renewing its lease
        (:meth:`CycleBooking.take_over`)."""
        await self.booking.take_over(backend, lease)

    def request_cooldown(
        self,
        backend_id: str,
        reason: str,
        min_rest_s: float = 0.0,
        force: bool = False,
        rest_done: RestDone | None = None,
    ) -> bool:
        """Run the medium cycle on a backend now, staggered unless ``force``; returns whether
        it started (:meth:`CycleBooking.request_cooldown`)."""
        return self.booking.request_cooldown(backend_id, reason, min_rest_s, force, rest_done)

    def gpu_fault(self, backend: Backend, reason: str) -> None:
        """A new Xid burst or ECC DBE on ``backend``'s GPUs: held out and restarted
        (:meth:`CycleBooking.gpu_fault`)."""
        self.booking.gpu_fault(backend, reason)

    async def stall_probe(self, backend: Backend) -> None:
        """Ask a stalled backend for one token (:meth:`CycleSteps.stall_probe`)."""
        await self.steps.stall_probe(backend)

    async def short_cycle(self, backend: Backend) -> None:
        """The short cycle, unleased (:meth:`CycleSteps.short_cycle`)."""
        await self.steps.short_cycle(backend)

    async def medium_cycle(
        self,
        backend: Backend,
        reason: str,
        min_rest_s: float = 0.0,
        rest_done: RestDone | None = None,
        lease: MaintenanceLease | None = None,
    ) -> None:
        """The medium cycle under ``lease``, unbooked (:meth:`CycleSteps.medium_cycle`)."""
        await self.steps.medium_cycle(backend, reason, min_rest_s, rest_done, lease)

    async def long_cycle(
        self, backend: Backend, reason: str, lease: MaintenanceLease | None = None
    ) -> None:
        """The long cycle under ``lease``, unbooked (:meth:`CycleSteps.long_cycle`)."""
        await self.steps.long_cycle(backend, reason, lease)
