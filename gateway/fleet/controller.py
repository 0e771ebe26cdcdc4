"""The fleet controller: composes the control plane's parts and starts and stops them.

Each part has one job (its module says which):

* :mod:`~gateway.fleet.state` (:class:`FleetState`): the one writer of the backends'
  control-plane records (transitions, holds, drains, maintenance markers, deferrals,
  configuration errors), the seam a shared store will back;
* :mod:`~gateway.fleet.loops`: runs the control loops, each surviving its own failures;
* :mod:`~gateway.fleet.clients`: the control plane's HTTP clients, reporting to the hung
  watchdog;
* :mod:`~gateway.fleet.health`: probes on a fixed tick and the hung watchdog's rounds;
* :mod:`~gateway.fleet.scraper`: load scrapes (parsing: :mod:`~gateway.fleet.telemetry`);
* :mod:`~gateway.fleet.model_discovery`: model discovery, the only reader of ``/v1/models``;
* :mod:`~gateway.fleet.warmup`, :mod:`~gateway.fleet.calibrator`,
  :mod:`~gateway.fleet.hooks`: warm-up, calibration runs, restart hook and vLLM routes;
* :mod:`~gateway.fleet.procedures`, :mod:`~gateway.fleet.drain`,
  :mod:`~gateway.fleet.maintenance`: one procedure per backend, drains, the lifecycle loop
  and its cycles;
* :mod:`~gateway.fleet.gpu_monitor`: GPU telemetry, thermal cooldowns, GPU faults;
* :mod:`~gateway.fleet.cold_start`: cold starts by stage, measured from discovery;
* :mod:`~gateway.fleet.membership`: backends that discovery adds and removes (the
  discovery source's task, the ``membership`` loop); a removed backend's probe, warm-up,
  stall probe, procedure and learnt engine endpoints are dropped here
  (:meth:`FleetController.forget`, a :meth:`Fleet.on_change` listener).

Every decision comes from the pure rules of :mod:`gateway.fleet.lifecycle`,
:mod:`~gateway.fleet.cycles` and :mod:`~gateway.fleet.liveness`. The request path reports
what it saw through :meth:`FleetController.auth_refused`,
:meth:`~FleetController.breaker_tripped` and :meth:`~FleetController.refresh_models_soon`
(the :class:`gateway.fleet.feedback.FleetFeedback` protocol).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from gateway.config import BackendConfig, GatewayConfig
from gateway.fleet import liveness
from gateway.fleet.backend import Backend
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.clients import ControlClients
from gateway.fleet.clock_driver import clock_driver
from gateway.fleet.cold_start import ColdStarts
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.fleet.gpu_monitor import GpuMonitor, RestDone
from gateway.fleet.health import HealthChecks
from gateway.fleet.hooks import BackendHooks
from gateway.fleet.leases import MaintenanceLeases
from gateway.fleet.loops import LoopBody, LoopRunner
from gateway.fleet.maintenance import Maintenance
from gateway.fleet.membership import CHECK_INTERVAL_S as MEMBERSHIP_INTERVAL_S
from gateway.fleet.membership import Membership
from gateway.fleet.model_discovery import ModelDiscovery
from gateway.fleet.probes import ProbeEndpoints
from gateway.fleet.procedures import Procedures
from gateway.fleet.scraper import LoadScraper
from gateway.fleet.sharing import SharedBaselines, SharedHolds
from gateway.fleet.state import FleetState
from gateway.fleet.warmup import Warmup
from gateway.metrics import GatewayMetrics


class FleetController:
    """The control plane over ``fleet`` (built by :meth:`Fleet.from_config`).

    ``clock`` is monotonic seconds (load samples, timers); ``wall`` is unix seconds
    (transition history shown to operators). Raises ``ConfigError`` for an unreadable
    calibration baseline file.
    """

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.state = FleetState(fleet, metrics, cfg.breaker.unhealthy_after_trips, clock, wall)
        self.loops = LoopRunner(metrics, wall, clock)
        self.clients = ControlClients(fleet, cfg.health, cfg.lifecycle, clock)
        # per (backend, model): the engine endpoint warm-up, probes and calibration use
        self.endpoints = ProbeEndpoints()
        self.discovery = ModelDiscovery(fleet, self.state, self.clients, clock)
        self.scraper = LoadScraper(fleet, self.state, self.clients, metrics, cfg.telemetry, clock)
        self.hooks = BackendHooks(cfg.lifecycle.restart_hook, self.clients, metrics)
        self.calibrator = Calibrator(
            cfg.calibration, self.state, self.clients, self.endpoints, self.hooks, metrics
        )
        self.warmup = Warmup(
            cfg.lifecycle, self.state, self.clients, self.discovery, self.calibrator,
            self.endpoints,
        )
        self.health = HealthChecks(
            cfg.health, fleet, self.state, self.clients, metrics, self.warmup.start, clock
        )
        self.procedures = Procedures(self.state, metrics)
        self.drains = Drains(cfg.lifecycle, self.state, self.procedures, metrics, clock)
        self.gpu = GpuMonitor(  # GPU telemetry, thermal cooldowns, Xid/ECC breaker
            cfg.thermal,
            cfg.power_domains,
            fleet,
            metrics,
            client=lambda: self.clients.control,
            busy=self.procedures.busy,
            request_cooldown=self.request_cooldown,
            gpu_fault=self._gpu_fault,
            medium_cooldown_s=cfg.lifecycle.medium.cooldown_s,
            clock=clock,
            expect_monitored=cfg.discovery.dynamic
            and cfg.discovery.template.gpu_metrics_url is not None,
            clocks=clock_driver(cfg.thermal, metrics, lambda: self.clients.control, clock),
        )
        self.maintenance = Maintenance(
            cfg, fleet, self.state, self.procedures, self.drains, self.clients,
            self.endpoints, self.calibrator, self.hooks, metrics,
            scheduled_rest=self.gpu.scheduled_rest_done, clock=clock,
        )
        self.state.listen(self.maintenance.back_in_service)  # no cycle right after a return
        self.membership = Membership(
            cfg.discovery, cfg.lifecycle, fleet, self.drains, metrics, clock
        )
        # cold starts by stage (gateway_cold_start_seconds), the autoscaler's measured one
        self.cold_starts = ColdStarts(fleet, self.state, metrics, clock)
        fleet.on_change(self._membership_changed)

    # ---- start / stop -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the control-plane clients, run one probe round, then start the loops.

        The first round is bounded by the probe timeout, so a healthy fleet is routable as
        soon as the gateway accepts traffic and a dead one never blocks start-up.
        """
        h, lc, t = self.cfg.health, self.cfg.lifecycle, self.cfg.telemetry
        self.clients.open()
        with self.state.starting_up(), contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(h.timeout_s + 1.0, min(lc.warmup_timeout_s, 10.0))):
                await self.health.probe_round()
                await self.warmup.wait_all()
        self.add_loop("probe", h.interval_s, self.health.probe_tick)
        self.add_loop("liveness", liveness.CHECK_INTERVAL_S, self.health.liveness_round)
        self.add_loop("scrape", t.scrape_interval_s, self.scraper.scrape_round)
        self.add_loop("models", t.models_refresh_s, self.discovery.models_round)
        self.add_loop("lifecycle", lc.check_interval_s, self.maintenance.lifecycle_round)
        if self.gpu.active:
            self.add_loop("gpu_telemetry", self.cfg.thermal.scrape_interval_s, self.gpu.round)
        if self.cfg.discovery.dynamic:
            self.add_loop("membership", MEMBERSHIP_INTERVAL_S, self.membership.round)

    def reconfigure_backends(
        self, backends: Sequence[BackendConfig], changed: Sequence[str]
    ) -> tuple[list[str], list[str]]:
        """A live reload's ``backends`` (:meth:`Membership.reconfigure_static`); the
        membership loop, which removes the drained ones, runs from then on even in a static
        fleet. Returns (added, leaving) ids."""
        out = self.membership.reconfigure_static(backends, changed)
        if not self.loops.has("membership"):
            self.add_loop("membership", MEMBERSHIP_INTERVAL_S, self.membership.round)
        return out

    async def stop(self) -> None:
        """Cancel every loop, warm-up, procedure and probe, then close the clients."""
        await self.membership.stop()
        await asyncio.gather(
            self.loops.stop(),
            self.warmup.stop(),
            self.procedures.stop(),
            self.maintenance.stop(),
            self.health.stop(),
        )
        await self.clients.close()

    def _membership_changed(self, backend: Backend, change: str) -> None:
        if change == "removed":
            self.forget(backend)

    def forget(self, backend: Backend) -> None:
        """``backend`` left the fleet: cancel its outstanding probe, warm-up, stall probe
        and procedure, and drop what was learnt of it (engine endpoints). Its record is
        detached: requests still holding it end there."""
        self.health.forget(backend)
        self.warmup.forget(backend)
        self.maintenance.forget(backend)
        self.procedures.forget(backend)
        self.endpoints.forget(backend.id)

    def add_loop(
        self, name: str, interval_s: float, body: LoopBody, stall_after_s: float | None = None
    ) -> None:
        """Run ``body`` every ``interval_s`` seconds until :meth:`stop`, as a control loop
        (:meth:`gateway.fleet.loops.LoopRunner.add_loop`; ``stall_after_s``: how long one
        round may run before the gateway is not ready)."""
        self.loops.add_loop(name, interval_s, body, stall_after_s)

    def use_leases(self, leases: MaintenanceLeases) -> None:
        """Fleet mode: every maintenance cycle runs under a lease from ``leases`` (the
        shared store's, :mod:`gateway.fleet.leases`) instead of one granted locally."""
        self.maintenance.use_leases(leases)

    # ---- what the request path reports (gateway.fleet.feedback.FleetFeedback) -----------
    def auth_refused(self, backend: Backend, detail: str, status: int | None) -> None:
        """``backend`` refused the gateway's credentials
        (:meth:`gateway.fleet.state.FleetState.auth_refused`)."""
        self.state.auth_refused(backend, detail, status)

    def breaker_tripped(self, backend: Backend) -> None:
        """``backend``'s circuit breaker opened
        (:meth:`gateway.fleet.state.FleetState.breaker_tripped`)."""
        self.state.breaker_tripped(backend)

    async def refresh_models_soon(self) -> None:
        """Refresh every backend's model list now, at most once a second
        (:meth:`gateway.fleet.model_discovery.ModelDiscovery.refresh_models_soon`)."""
        await self.discovery.refresh_models_soon()

    @property
    def longest_drain_s(self) -> float:
        """The longest drain since start, seconds (reported by drills)."""
        return self.drains.longest_drain_s

    # ---- what the admin API calls ---------------------------------------------------------
    def busy(self, backend: Backend) -> bool:
        """Whether a maintenance procedure (cycle, drain) is running on ``backend``."""
        return self.procedures.busy(backend)

    def start_drain(self, backend: Backend, deadline_s: float, preempt: bool = False) -> bool:
        """Admin drain or spot preemption (:meth:`gateway.fleet.drain.Drains.start_drain`)."""
        return self.drains.start_drain(backend, deadline_s, preempt)

    def undrain(self, backend: Backend) -> bool:
        """Back to rotation (:meth:`gateway.fleet.drain.Drains.undrain`)."""
        return self.drains.undrain(backend)

    def request_cooldown(
        self,
        backend_id: str,
        reason: str,
        min_rest_s: float = 0.0,
        force: bool = False,
        rest_done: RestDone | None = None,
    ) -> bool:
        """Run the medium cycle now
        (:meth:`gateway.fleet.maintenance.Maintenance.request_cooldown`)."""
        return self.maintenance.request_cooldown(backend_id, reason, min_rest_s, force, rest_done)

    def share_verdicts(self, holds: SharedHolds, baselines: SharedBaselines) -> None:
        """Fleet mode: GPU-fault holds and restart claims through ``holds``, calibration
        baselines through ``baselines`` (:mod:`gateway.fleet.sharing`; default: this
        process's own)."""
        self.drains.share(holds)
        self.calibrator.share(baselines)

    def _gpu_fault(self, backend: Backend, reason: str) -> None:
        self.maintenance.gpu_fault(backend, reason)
