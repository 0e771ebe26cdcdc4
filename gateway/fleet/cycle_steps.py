"""The steps of each maintenance procedure on one backend: the short, medium and long
cycles, the stall probe, and the restart after a GPU fault (what starts them, and when:
:mod:`gateway.fleet.maintenance` and :mod:`gateway.fleet.cycle_booking`).

* short: an application probe through the engine; ``unhealthy`` if it fails;
* medium: drain -> reset prefix cache -> rest (probes only; optional vLLM sleep) ->
  calibration -> slow-start return;
* long: drain -> restart hook -> ``cold`` (probes then bring it through warming);
* stall probe: one token asked of a backend whose in-flight requests got nothing back for
  ``health.stall_after_s``; ``unhealthy`` (``engine_stalled``) if it fails.

A medium or long cycle runs under its maintenance lease (:mod:`gateway.fleet.leases`): each
step is recorded in it before it is taken, so a replica taking over a dead holder's lease
resumes the cycle from the step it reached, and a cycle whose lease was lost (another
replica holds it now) stops before its next side effect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState, Cut
from gateway.fleet.backend import Backend
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.clients import ControlClients
from gateway.fleet.cycles import CycleKind
from gateway.fleet.drain import Drains
from gateway.fleet.hooks import BackendHooks
from gateway.fleet.leases import LeasePhase, LocalLeases, MaintenanceLease, MaintenanceLeases
from gateway.fleet.probes import ProbeEndpoints, app_probe
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")

# The end condition of a rest (argument: seconds rested), see CycleSteps.medium_cycle.
RestDone = Callable[[float], bool]


class CycleSteps:
    """The maintenance procedures' steps on a backend of the fleet under ``cfg``, recorded in
    ``leases`` (:meth:`gateway.fleet.maintenance.Maintenance.use_leases` replaces them in
    fleet mode); ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        state: FleetState,
        drains: Drains,
        clients: ControlClients,
        endpoints: ProbeEndpoints,
        calibrator: Calibrator,
        hooks: BackendHooks,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.drains = drains
        self.clients = clients
        self.endpoints = endpoints
        self.calibrator = calibrator
        self.hooks = hooks
        self.metrics = metrics
        self.clock = clock
        self.leases: MaintenanceLeases = LocalLeases()

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

    async def gpu_restart(self, backend: Backend, reason: str) -> None:
        """The restart after a GPU fault (``reason``: ``gpu_xid`` / ``gpu_ecc``): the restart
        hook runs on the one replica that claims it; after a successful hook the hold is
        ``restarting`` (as after the long cycle's)."""
        if not await self.drains.shared.claim_gpu_restart(backend, reason):
            log.info(
                "backend %s: %s; another replica runs the restart hook", backend.id, reason
            )
            return
        if await self.hooks.run_restart_hook(backend):
            self.drains.hold_restarting(backend, self.cfg.lifecycle.restart_hold_s)
