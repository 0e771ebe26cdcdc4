"""The GPU telemetry loop and what it triggers: thermal cooldowns and the GPU health breaker.

Every ``thermal.scrape_interval_s`` (2 s) the loop scrapes each backend's
``gpu_metrics_url`` (DCGM exporter names, :func:`gateway.fleet.telemetry.scrape_gpus`), all
backends concurrently, whatever their state (the exporter is not vLLM: a resting or
restarting backend's GPUs are still read). Then, from the pure rules:

* the fleet's :class:`~gateway.routing.thermal.ThermalView` is rebuilt; the request path
  (:meth:`GpuMonitor.choose`) and admission (:meth:`GpuMonitor.power_level`) read it;
* a ``warm`` backend that is ``hot`` is sent to cooldown through the lifecycle's entry
  point (:meth:`FleetController.request_cooldown`, staggered like every cycle) with a rest
  that ends when :func:`~gateway.routing.cooldown.rest_over` says so: below
  ``resume_c`` after at least ``cooldown_s``, or ``max_cooldown_s`` (the cap);
* new Xid / double-bit ECC errors (:class:`~gateway.fleet.gpu_health.GpuHealth`) make the
  backend ``unhealthy`` (``gpu_xid`` / ``gpu_ecc``) and run the restart hook. After a
  successful hook it is held out until the restart is seen (as the long cycle does); without
  a hook, or when it fails, it is held (``hold: gpu_fault``) until an operator undrains it,
  since passing probes say nothing about a GPU that raised Xid errors.

A backend without ``gpu_metrics_url`` has no tracker: its tier is ``unknown`` by design
and it is routed as before thermal awareness (it is never scraped, never counted unknown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import httpx

from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.gpu_health import GpuHealth
from gateway.fleet.telemetry import scrape_gpus
from gateway.routing.cooldown import cooldown_due, rest_over
from gateway.routing.thermal import (
    C,
    ThermalChoice,
    ThermalTier,
    ThermalTracker,
    ThermalView,
    build_view,
    choose,
    power_pressure,
)

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController

S = BackendState
log = logging.getLogger("gateway.fleet.gpu")


class GpuMonitor:
    """GPU telemetry of the fleet, owned by the :class:`FleetController`."""

    def __init__(self, controller: FleetController) -> None:
        self.controller = controller
        self.cfg = controller.cfg.thermal
        self.metrics = controller.metrics
        self.budgets_w = {d.name: d.budget_w for d in controller.cfg.power_domains}
        self.domain_of = {b.id: b.config.power_domain for b in controller.fleet}
        for b in controller.fleet:
            if b.config.gpu_metrics_url is not None:
                b.thermal = ThermalTracker(self.cfg)
                b.gpu_health = GpuHealth(self.cfg.xid_threshold, self.cfg.xid_window_s)
        self.monitored = [b for b in controller.fleet if b.thermal is not None]
        self.view: ThermalView = self._build(controller.clock())  # all unknown until scraped
        self._last_tier: dict[str, ThermalTier] = {}
        if self.monitored or self.budgets_w:
            self.metrics.attach_thermal(lambda: self.view, controller.clock)

    # ---- the loop ------------------------------------------------------------------------
    async def round(self) -> None:
        """One GPU telemetry round: scrape all, rebuild the view, apply triggers."""
        await asyncio.gather(*(self.scrape_one(b) for b in self.monitored))
        self.refresh()
        self.apply_triggers()

    def refresh(self) -> None:
        """Rebuild the view from the trackers now; count backends that turned unknown."""
        now = self.controller.clock()
        self.view = self._build(now)
        for b in self.monitored:
            tier = self.view.status(b.id, now).tier
            before = self._last_tier.get(b.id)
            if tier is ThermalTier.UNKNOWN and before is not ThermalTier.UNKNOWN:
                self.metrics.gpu_telemetry_unknown.labels(b.id).inc()
                log.warning(
                    "backend %s: GPU telemetry missing or stale (%s): thermal tier unknown",
                    b.id,
                    b.gpu_error or "no recent sample",
                )
            self._last_tier[b.id] = tier

    def _build(self, now: float) -> ThermalView:
        trackers = {b.id: b.thermal for b in self.controller.fleet}
        return build_view(now, trackers, self.domain_of, self.budgets_w, self.cfg)

    async def scrape_one(self, backend: Backend) -> None:
        url = str(backend.config.gpu_metrics_url)
        c = self.controller
        try:
            sample = await scrape_gpus(
                c.client,
                url,
                c.clock,
                backend.config.gpu_indices,
                timeout_s=self.cfg.scrape_timeout_s,
            )
        except (httpx.HTTPError, ValueError) as e:
            backend.gpu_error = f"{type(e).__name__}: {e}".rstrip(": ")
            self.metrics.gpu_scrape_errors.labels(backend.id).inc()
            return
        backend.gpu_error = None
        backend.thermal.observe(sample)
        health: GpuHealth = backend.gpu_health
        xids, ecc = health.total_xids, health.total_ecc
        reason = health.observe(sample)
        if health.total_xids > xids:
            self.metrics.gpu_errors.labels(backend.id, "xid").inc(health.total_xids - xids)
        if health.total_ecc > ecc:
            self.metrics.gpu_errors.labels(backend.id, "ecc_dbe").inc(health.total_ecc - ecc)
        if reason is not None:
            self.gpu_fault(backend, reason, sample.xid_last)

    # ---- thermal cooldowns -----------------------------------------------------------------
    def apply_triggers(self) -> None:
        """Send every warm, hot backend to a thermal cooldown (when staggering allows)."""
        if not self.cfg.enabled:
            return
        c = self.controller
        now = c.clock()
        for b in self.monitored:
            st = self.view.status(b.id, now)
            if not cooldown_due(b.state, st, self.cfg) or c.busy(b):
                continue
            if c.request_cooldown(b.id, "thermal", rest_done=self.rest_done(b)):
                self.metrics.thermal_cooldowns.labels(b.id).inc()
                log.warning(
                    "backend %s: GPU at %.1f °C (hot >= %.0f °C): thermal cooldown until "
                    "below %.0f °C and at least %.0f s",
                    b.id,
                    st.temp_c or float("nan"),
                    self.cfg.hot_c,
                    self.cfg.resume_c,
                    self.cfg.cooldown_s,
                )

    def rest_done(self, backend: Backend) -> Callable[[float], bool]:
        """The end condition of ``backend``'s thermal rest (argument: seconds rested)."""
        c = self.controller

        def done(rested_s: float) -> bool:  # the cap may release it between 70 and 85 °C
            return rest_over(backend.thermal, rested_s, c.clock(), self.cfg)

        return done

    def scheduled_rest_done(self, backend: Backend) -> Callable[[float], bool] | None:
        """The end condition of a *scheduled* medium cycle's rest on ``backend`` (argument:
        seconds rested), or None without GPU telemetry (then the fixed
        ``lifecycle.medium.cooldown_s`` applies): the rest lasts as long as the GPU needs and
        no longer, so it ends at the first fresh reading below ``resume_c`` (at once when the
        GPU is already cool), at ``max_cooldown_s`` at most; while telemetry is stale or
        reads no temperature, after ``lifecycle.medium.cooldown_s`` as without it."""
        tracker = backend.thermal
        if tracker is None or not self.cfg.enabled:
            return None
        c = self.controller
        fallback_s = c.cfg.lifecycle.medium.cooldown_s

        def done(rested_s: float) -> bool:
            if rested_s >= self.cfg.max_cooldown_s:
                return True
            s = tracker.latest
            if not tracker.fresh(c.clock()) or s is None or s.temp_c is None:
                return rested_s >= fallback_s  # no temperature to wait for
            return s.temp_c < self.cfg.resume_c

        return done

    # ---- GPU health breaker -------------------------------------------------------------------
    def gpu_fault(self, backend: Backend, reason: str, xid_last: tuple[int, ...]) -> None:
        """New Xid burst or ECC DBE: ``unhealthy`` now, then the restart hook."""
        c = self.controller
        what = (
            f"{self.cfg.xid_threshold} or more new Xid errors within "
            f"{self.cfg.xid_window_s:g} s (last codes {list(xid_last)})"
            if reason == "gpu_xid"
            else "a new double-bit ECC error"
        )
        backend.note_error(f"GPU fault: {what}")
        log.error("backend %s: GPU fault (%s): %s", backend.id, reason, what)
        if backend.state in (S.WARM, S.WARMING, S.DRAINING, S.COOLDOWN):
            c.transition(backend, S.UNHEALTHY, reason)
        backend.hold = "gpu_fault"  # out until the restart is seen or an admin undrains
        backend.hold_until = None
        c._run(backend, "gpu_restart", self._restart(backend))

    async def _restart(self, backend: Backend) -> None:
        c = self.controller
        if await c.run_restart_hook(backend):
            backend.hold = "restarting"
            backend.hold_until = c.clock() + c.cfg.lifecycle.restart_hold_s

    # ---- what the request path and admission read ---------------------------------------------
    def choose(self, candidates: Sequence[C], now: float) -> ThermalChoice[C]:
        """:func:`gateway.routing.thermal.choose` over the current view."""
        view = self.view
        choice = choose(candidates, lambda b: view.status(b.id, now), view.domains, self.cfg)
        if choice.all_hot:
            self.metrics.thermal_all_hot.inc()
        return choice

    def power_level(self, candidates: Sequence[Backend], now: float) -> float:
        """Draw / budget of the roomiest power domain among ``candidates`` (0: no domains,
        or a candidate outside any domain)."""
        if not self.budgets_w or not self.cfg.enabled:
            return 0.0
        view = self.view
        if now - view.at > view.stale_after_s:
            return 0.0  # nothing known: admission is not tightened on a guess
        return power_pressure((self.domain_of.get(b.id) for b in candidates), view.domains)
