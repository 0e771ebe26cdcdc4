"""Maintenance: the lifecycle loop that starts due cycles, the cycles themselves, thermal
and admin cooldowns, the stall probe, and the response to a GPU fault.

Every ``lifecycle.check_interval_s`` (:meth:`Maintenance.lifecycle_round`): a warm
backend's latency fuse is evaluated; one with requests in flight and nothing back for
``health.stall_after_s`` gets a stall probe; then every cycle that is due starts, the most
overdue backends first, staggered per model (:func:`gateway.fleet.lifecycle.may_take_out`)
and, for those that take a backend out, deferred while the other backends could not carry
the load (:func:`gateway.fleet.lifecycle.can_carry_without`; skipped after
``lifecycle.max_defer_s``). The cycles (:mod:`gateway.fleet.cycles`):

* short: an application probe through the engine; ``unhealthy`` if it fails;
* medium: drain -> reset prefix cache -> rest (probes only; optional vLLM sleep) ->
  calibration -> slow-start return;
* long: drain -> restart hook -> ``cold`` (probes then bring it through warming).

Each runs as the backend's one procedure (:class:`gateway.fleet.procedures.Procedures`),
under a maintenance lease (:mod:`gateway.fleet.leases`) taken before it changes anything and
given back when it ends. One gateway's leases (:class:`~gateway.fleet.leases.LocalLeases`)
are granted at once; in fleet mode (:meth:`Maintenance.use_leases`) the lease is taken in the
shared store, so one replica runs each backend's cycle for the whole fleet, the drain waits
for every replica's requests, and a replica taking over a dead holder's lease finishes the
cycle from the step it reached (:meth:`Maintenance.take_over`). A cycle whose lease was
lost (another replica holds it now) stops its side effects; a cycle cancelled by the
gateway's stop keeps its lease until it expires, so another replica finishes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState, Cut
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.clients import ControlClients
from gateway.fleet.cycles import (
    SPREAD_SLOTS,
    CycleKind,
    back_from_outage,
    came_back,
    cycle_started,
    due_cycle,
    spread_slot,
)
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.fleet.hooks import BackendHooks
from gateway.fleet.leases import (
    LeasePhase,
    LocalLeases,
    MaintenanceLease,
    MaintenanceLeases,
    takes_out,
)
from gateway.fleet.probes import ProbeEndpoints, app_probe
from gateway.fleet.procedures import Procedures
from gateway.fleet.records import Deferral, Transition
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")

# The end condition of a rest (argument: seconds rested), see Maintenance.medium_cycle.
RestDone = Callable[[float], bool]


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
        self.drains = drains
        self.clients = clients
        self.endpoints = endpoints
        self.calibrator = calibrator
        self.hooks = hooks
        self.metrics = metrics
        self.scheduled_rest = scheduled_rest
        self.clock = clock
        self._forecast_rps: Callable[[str], float | None] | None = None
        self._rollouts: Callable[[], lifecycle.RolloutVersions] | None = None
        self._stall: dict[str, asyncio.Task[None]] = {}  # the running stall probe of each
        self.leases: MaintenanceLeases = LocalLeases()

    def use_leases(self, leases: MaintenanceLeases) -> None:
        """Take maintenance leases from ``leases`` (fleet mode: the shared store) instead of
        granting them locally."""
        self.leases = leases

    def use_forecast(self, forecast_rps: Callable[[str], float | None]) -> None:
        """Read ``forecast_rps`` (requests/s forecast for a model) before a cycle takes a
        backend out."""
        self._forecast_rps = forecast_rps

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
                self._stall[b.id] = asyncio.get_running_loop().create_task(self.stall_probe(b))
        now = self.clock()
        for b in self.fleet:
            if b.deferred is not None and b.state is not S.WARM:
                self.state.set_deferral(b, None)  # it left rotation another way
                self.metrics.cycle_deferred.labels(b.id).set(0)
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
                    self._defer(b, kind, why, now)
                    if now >= b.cycles.next_short:  # the engine probe is not held back
                        short = await self._acquire(b, CycleKind.SHORT, "scheduled")
                        if short is not None:
                            cycle_started(
                                b.cycles, CycleKind.SHORT, now, b.requests_served, lc
                            )
                            self.metrics.cycles.labels(b.id, CycleKind.SHORT.value).inc()
                            self._run(b, "short", short, self.short_cycle(b))
                    continue  # deferred: it stays due and starts at the next quiet moment
            lease = await self._acquire(b, kind, "scheduled")
            if lease is None:
                continue  # another replica runs it, or staggering across replicas: still due
            self._end_deferral(b, now)
            cycle_started(b.cycles, kind, now, b.requests_served, lc)
            self.metrics.cycles.labels(b.id, kind.value).inc()
            if kind is CycleKind.SHORT:
                self._run(b, "short", lease, self.short_cycle(b))
            elif kind is CycleKind.MEDIUM:
                self.state.transition(b, S.DRAINING, "cooldown_scheduled")
                self._run(
                    b,
                    "medium",
                    lease,
                    self.medium_cycle(
                        b, "scheduled", rest_done=self.scheduled_rest(b), lease=lease
                    ),
                )
            else:
                self.state.transition(b, S.DRAINING, "restart_scheduled")
                self._run(b, "long", lease, self.long_cycle(b, "scheduled", lease))

    async def _acquire(
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

    def _run(
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
            cycle = self.medium_cycle(backend, lease.reason, lease=lease)
        elif lease.cycle is CycleKind.LONG and lease.phase is not LeasePhase.RESTARTING:
            cycle = self.long_cycle(backend, lease.reason, lease)
        else:
            cycle = _done()
        self._run(backend, lease.cycle.value, lease, cycle)

    def demand(self) -> dict[str, float]:
        """Requests per second each model must be served at now and over the forecast
        horizon: the larger of the completion rate its backends report (summed) and the
        arrival forecast's mean (:meth:`use_forecast`, when there is one)."""
        out: dict[str, float] = {}
        for b in self.fleet:
            serving = b.state in lifecycle.SERVING
            for m in b.models:  # a backend out of service (dead) adds no demand
                out[m] = out.get(m, 0.0) + (b.service.completion_rate if serving else 0.0)
        if self._forecast_rps is not None:
            for m in out:
                f = self._forecast_rps(m)
                if f is not None and f > out[m]:
                    out[m] = f
        return out

    def _defer(self, b: Backend, kind: CycleKind, why: str, now: float) -> None:
        """Hold a due cycle back (the others cannot carry the load); after
        ``lifecycle.max_defer_s`` it is skipped until its next period."""
        lc = self.cfg.lifecycle
        if b.deferred is None or b.deferred.cycle != kind.value:
            self.state.set_deferral(b, Deferral(kind.value, now, why))
            self.metrics.cycle_deferrals.labels(b.id, kind.value, "deferred").inc()
            self.metrics.cycle_deferred.labels(b.id).set(1)
            log.info("backend %s: %s cycle deferred: %s", b.id, kind.value, why)
            return
        since = b.deferred.since
        self.state.set_deferral(b, Deferral(kind.value, since, why))
        if now - since >= lc.max_defer_s:
            log.warning(
                "backend %s: %s cycle skipped after %.0f s deferred (%s); next one in a period",
                b.id, kind.value, now - since, why,
            )
            self.metrics.cycle_deferrals.labels(b.id, kind.value, "skipped").inc()
            cycle_started(b.cycles, kind, now, b.requests_served, lc)
            self.state.set_deferral(b, None)
            self.metrics.cycle_deferred.labels(b.id).set(0)

    def _end_deferral(self, b: Backend, now: float) -> None:
        if b.deferred is not None:
            log.info(
                "backend %s: %s cycle starts after %.0f s deferred",
                b.id, b.deferred.cycle, now - b.deferred.since,
            )
            self.metrics.cycle_deferral_seconds.observe(now - b.deferred.since)
            self.state.set_deferral(b, None)
            self.metrics.cycle_deferred.labels(b.id).set(0)

    async def stall_probe(self, backend: Backend) -> None:
        """Requests are in flight but nothing came back for ``health.stall_after_s``: ask for
        one token now. A backend whose ``/health`` still passes while its engine is stuck
        fails here: it goes ``unhealthy`` (``engine_stalled``) and its requests are ended
        (those still waiting for a first byte are re-sent elsewhere; streams get an error
        event)."""
        if not backend.models:
            return
        h = self.cfg.health
        res = await app_probe(
            self.clients.work,
            backend,
            backend.models[0],
            backend.api_key,
            timeout_s=h.stall_probe_timeout_s,
            endpoints=self.endpoints,
        )
        if res.unserved:  # it answered (a 4xx on every endpoint): alive, no verdict
            self.calibrator.unserved(backend, backend.models[0], "app_probe", res.detail)
        if res.ok:
            backend.stall_cleared(self.clock())  # alive: look again after another stall
            return
        backend.note_error(f"engine stalled: {res.detail}")
        log.warning(
            "backend %s: in-flight requests got nothing for %.0f s and a 1-token probe failed (%s)",
            backend.id,
            h.stall_after_s,
            res.detail,
        )
        if backend.state is S.WARM:
            self.state.transition(backend, S.UNHEALTHY, "engine_stalled")
        for handle in list(backend.active):
            handle.cut(Cut.BACKEND_HUNG)

    async def short_cycle(self, backend: Backend) -> None:
        """Probe through the engine; no traffic change unless it fails."""
        if not backend.models:
            return
        res = await app_probe(
            self.clients.work,
            backend,
            backend.models[0],
            backend.api_key,
            self.cfg.lifecycle.app_probe_max_tokens,
            endpoints=self.endpoints,
        )
        if res.unserved:  # it answered (a 4xx on every endpoint): alive, no verdict
            self.calibrator.unserved(backend, backend.models[0], "app_probe", res.detail)
            return
        if res.ok:
            backend.app_probe_passed(res.ttft_s)
            if res.ttft_s is not None:
                self.metrics.probe_ttft.labels(backend.id).set(res.ttft_s)
            return
        backend.note_error(res.detail)
        if backend.state is S.WARM:
            self.state.transition(backend, S.UNHEALTHY, "app_probe_failed")

    async def medium_cycle(
        self,
        backend: Backend,
        reason: str,
        min_rest_s: float = 0.0,
        rest_done: Callable[[float], bool] | None = None,
        lease: MaintenanceLease | None = None,
    ) -> None:
        """Drain -> reset prefix cache -> rest (probes only; optional vLLM sleep) ->
        calibration -> slow-start return, under ``lease`` (None: a local one).

        The rest lasts ``max(medium.cooldown_s, min_rest_s)`` seconds, or, with
        ``rest_done`` (called with the seconds rested so far), until it returns True: a
        thermal cooldown rests until the GPU is cool (:mod:`gateway.fleet.gpu_monitor`).

        A lease taken over from another replica resumes where its record says the cycle
        was: its drain (then the wait for every replica's), the reset unless done, the rest
        until the end it announced (a rest announced without an end: the fixed rest), the
        wake-up if vLLM sleeps. A lost lease stops the cycle before its next side effect."""
        lc = self.cfg.lifecycle
        if lease is None:
            lease = MaintenanceLease(backend.id, CycleKind.MEDIUM, reason, LeasePhase.DRAINING)
        if lease.phase is LeasePhase.DRAINING or backend.state is not S.COOLDOWN:
            deadline_s = (
                lc.drain_deadline_s
                if lease.drain_deadline is None
                else max(0.0, lease.drain_deadline - self.clock())
            )
            if not await self.drains.drain(backend, deadline_s, f"cooldown_{reason}"):
                return
            if lease.phase is LeasePhase.DRAINING:
                await self.leases.fleet_drained(backend, lease)
            if lease.lost or backend.state is not S.DRAINING:
                return
            self.state.transition(backend, S.COOLDOWN, "drained")
            lease.enter(LeasePhase.COOLDOWN)
        if not lease.reset_done:
            # recorded before it is sent: a replica taking the cycle over never resets twice
            lease.mark_reset()
            await self.leases.publish(lease)
            if lease.lost:
                return
            await self.hooks.reset_prefix_cache(backend)
        if lease.rest_end is None and not lease.slept:
            rest = max(lc.medium.cooldown_s, min_rest_s)
            # no sleep the other replicas might not see (the store not answering now)
            will_sleep = lc.medium.sleep and self.leases.confirmed(lease)
            if will_sleep:  # recorded first: a replica taking the cycle over wakes it
                lease.mark_slept(True)
                lease.resting_until(self.clock() + rest if rest_done is None else None)
                will_sleep = await self.leases.publish(lease)
                if lease.lost:
                    return
            slept = will_sleep and await self.hooks.vllm_post(backend, "/sleep?level=1")
            lease.mark_slept(slept)
            start = self.clock()
            deadline = start + rest
            lease.resting_until(deadline if rest_done is None else None)
        else:  # resumed: the rest its first holder announced
            slept, rest_done = lease.slept, None
            start = self.clock()
            deadline = start + lc.medium.cooldown_s
            if lease.rest_end is not None:
                deadline = lease.rest_end

        def resting() -> bool:
            now = self.clock()
            return now < deadline if rest_done is None else not rest_done(now - start)

        while resting():
            if backend.state is not S.COOLDOWN or lease.lost:
                return  # a probe failed meanwhile, an admin undrained it, or the lease moved
            wait = 0.25 if rest_done is not None else min(0.25, max(0.0, deadline - self.clock()))
            await asyncio.sleep(wait)
        if lease.lost:
            return
        if slept:
            await self.leases.publish(lease)  # still ours? (else the new holder wakes it)
            if lease.lost:
                return
            await self.hooks.vllm_post(backend, "/wake_up")
            lease.mark_slept(False)
            await self.leases.publish(lease)  # awake: a replica taking over does not wake it
        if backend.state is not S.COOLDOWN:
            return
        if not await self.calibrator.calibrate(backend):
            return
        if backend.hold is not None:  # drained (stays out) or preempted (cold) meanwhile
            self.drains.rest_over_held(backend)
            return
        if backend.state is S.COOLDOWN:
            self.state.transition(backend, S.WARM, "cooldown_done")

    async def long_cycle(
        self, backend: Backend, reason: str, lease: MaintenanceLease | None = None
    ) -> None:
        """Drain -> restart hook -> ``cold`` (probes then bring it through warming), under
        ``lease`` (None: a local one)."""
        deadline_s = self.cfg.lifecycle.drain_deadline_s
        if lease is not None and lease.drain_deadline is not None:
            deadline_s = max(0.0, lease.drain_deadline - self.clock())
        if not await self.drains.drain(backend, deadline_s, f"restart_{reason}"):
            return
        if lease is not None:
            await self.leases.fleet_drained(backend, lease)
            if lease.lost or backend.state is not S.DRAINING:
                return
            lease.enter(LeasePhase.RESTARTING)
            await self.leases.publish(lease)  # before the hook: the others take it out too
            if lease.lost:
                return
        before = backend.load.process_start_s if backend.load is not None else None
        if await self.hooks.run_restart_hook(backend):
            # Hold it out until the restart is seen (a failed probe, or a scrape showing a
            # new server process) or the hold passes, so the old process does not take
            # traffic in the moment before it goes away.
            until = self.clock() + self.cfg.lifecycle.restart_hold_s
            self.state.hold(backend, "restarting", until, restart_seen_after=before)
        if backend.state is S.DRAINING:
            self.state.transition(backend, S.COLD, "restarted")

    def request_cooldown(
        self,
        backend_id: str,
        reason: str,
        min_rest_s: float = 0.0,
        force: bool = False,
        rest_done: Callable[[float], bool] | None = None,
    ) -> bool:
        """Run the medium cycle on a backend now: the entry point for the admin API and for
        thermal triggers. Respects staggering (``max_unavailable``, never the last warm
        backend of a model) unless ``force``. ``rest_done`` replaces the fixed rest (see
        :meth:`medium_cycle`). Returns whether the cycle started."""
        backend = self.fleet.get(backend_id)
        if backend is None or self.procedures.busy(backend) or backend.state is not S.WARM:
            return False
        if not force and not lifecycle.may_take_out(
            backend, self.fleet.backends, self.cfg.lifecycle, self.rollout_versions()
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
        cycle = self.medium_cycle(backend, reason, min_rest_s, rest_done, lease)
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
        rest_done: Callable[[float], bool] | None,
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
            await self.medium_cycle(backend, reason, min_rest_s, rest_done, lease)
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
        self.procedures.run(backend, "gpu_restart", self._gpu_restart(backend, reason))

    async def _gpu_restart(self, backend: Backend, reason: str) -> None:
        if not await self.drains.shared.claim_gpu_restart(backend, reason):
            log.info(
                "backend %s: %s; another replica runs the restart hook", backend.id, reason
            )
            return
        if await self.hooks.run_restart_hook(backend):
            self.drains.hold_restarting(backend, self.cfg.lifecycle.restart_hold_s)


async def _done() -> None:
    """A cycle with nothing left to do (a short cycle taken over, a restart already under
    way)."""
