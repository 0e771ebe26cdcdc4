"""The GPU telemetry loop and what it triggers: thermal cooldowns and the GPU health breaker.

Every ``thermal.scrape_interval_s`` (2 s) the loop scrapes each backend's
``gpu_metrics_url`` (DCGM exporter names, :func:`gateway.fleet.telemetry.scrape_gpus`), all
backends concurrently, whatever their state (the exporter is not vLLM: a resting or
restarting backend's GPUs are still read). Then, from the pure rules:

* the fleet's :class:`~gateway.routing.thermal.ThermalView` is rebuilt; the request path
  (:meth:`GpuMonitor.choose`) and admission (:meth:`GpuMonitor.power_level`) read it;
* a ``warm`` backend that is ``hot`` is sent to cooldown through the lifecycle's entry
  point (the ``request_cooldown`` callback:
  :meth:`gateway.fleet.maintenance.Maintenance.request_cooldown`, staggered like every
  cycle) with a rest that ends when :func:`~gateway.routing.cooldown.rest_over` says so:
  below
  ``resume_c`` after at least ``cooldown_s``, or ``max_cooldown_s`` (the cap);
* new Xid / double-bit ECC errors (:class:`~gateway.fleet.gpu_health.GpuHealth`) are a
  GPU fault (the ``gpu_fault`` callback:
  :meth:`gateway.fleet.maintenance.Maintenance.gpu_fault`): the backend goes ``unhealthy``
  (``gpu_xid`` / ``gpu_ecc``) and the restart hook runs. After a successful hook it is held
  out until the restart is seen (as the long cycle does); without a hook, or when it fails,
  it is held (``hold: gpu_fault``) until an operator undrains it, since passing probes say
  nothing about a GPU that raised Xid errors.

With ``thermal.clocks.enabled`` (issue 21) each round also runs the clock controller
(:class:`gateway.fleet.clock_driver.ClockDriver`) before the triggers: a warm backend whose
clock cap is not yet at its floor is capped rather than sent to cooldown, and power shedding
(:meth:`GpuMonitor.power_level`) starts only when the caps of the candidates' GPUs are at
their floor and their power limits are set (:mod:`gateway.routing.power_limits`), with
hysteresis (:class:`gateway.routing.clocks.PowerShedGate`).

A backend without ``gpu_metrics_url`` has no tracker: its tier is ``unknown`` by design
and it is routed as before thermal awareness (it is never scraped, never counted unknown).
The trackers are the backends' own parts (built by :class:`gateway.fleet.fleet.Fleet`);
the monitor takes what it needs through its constructor, never the controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx

from gateway.config import PowerDomainConfig, ThermalConfig
from gateway.core.urls import failure_detail
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.clock_driver import ClockDriver
from gateway.fleet.fleet import Fleet
from gateway.fleet.telemetry import scrape_gpus
from gateway.metrics import GatewayMetrics
from gateway.routing.cooldown import cooldown_due, rest_over
from gateway.routing.thermal import (
    C,
    ThermalChoice,
    ThermalTier,
    ThermalView,
    build_view,
    choose,
    power_pressure,
)

S = BackendState
log = logging.getLogger("gateway.fleet.gpu")


# The end condition of a rest (argument: seconds rested).
RestDone = Callable[[float], bool]


class RequestCooldown(Protocol):
    """Start a medium cycle on a backend now; whether it started."""

    def __call__(self, backend_id: str, reason: str, *, rest_done: RestDone | None = None) -> bool:
        """``backend_id``: which; ``reason``: e.g. ``thermal``; ``rest_done``: when the
        rest ends (argument: seconds rested)."""


class GpuMonitor:
    """GPU telemetry of ``fleet`` under ``cfg`` (``power_domains``: the rack budgets).

    ``client``: the control-plane HTTP client (called per scrape: it is opened when the
    controller starts); ``busy``: whether a maintenance procedure runs on a backend;
    ``request_cooldown(backend_id, reason, rest_done=...)``: start a medium cycle, True
    when it started; ``gpu_fault(backend, reason)``: a GPU fault (``gpu_xid`` /
    ``gpu_ecc``) to act on; ``medium_cooldown_s``: the fixed rest of a medium cycle
    without telemetry (seconds); ``clock``: monotonic seconds; ``expect_monitored``:
    backends discovery adds will have GPU telemetry (run the loop, export the gauges,
    even while none is in the fleet). :attr:`active`: whether the loop runs."""

    def __init__(
        self,
        cfg: ThermalConfig,
        power_domains: Sequence[PowerDomainConfig],
        fleet: Fleet,
        metrics: GatewayMetrics,
        client: Callable[[], httpx.AsyncClient],
        busy: Callable[[Backend], bool],
        request_cooldown: RequestCooldown,
        gpu_fault: Callable[[Backend, str], None],
        medium_cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        expect_monitored: bool = False,
        clocks: ClockDriver | None = None,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.metrics = metrics
        self.client = client
        self.busy = busy
        self.request_cooldown = request_cooldown
        self.on_fault = gpu_fault
        self.medium_cooldown_s = medium_cooldown_s
        self.clock = clock
        self.clocks = clocks
        self.budgets_w = {d.name: d.budget_w for d in power_domains}
        # discovered backends will have GPU telemetry (the discovery template's
        # gpu_metrics_url): the loop runs even while none is in the fleet yet
        self.active = any(b.thermal is not None for b in fleet) or expect_monitored
        self._version = -1
        self._domain_of: dict[str, str | None] = {}
        self._monitored: list[Backend] = []
        self._last_tier: dict[str, ThermalTier] = {}
        self.view: ThermalView = self._build(clock())  # all unknown until scraped
        if self.active or self.budgets_w:
            self.metrics.attach_thermal(lambda: self.view, clock)

    def _follow(self) -> None:
        """Rebuild the per-backend tables when the fleet's membership changed."""
        if self._version != self.fleet.version:
            self._domain_of = {b.id: b.config.power_domain for b in self.fleet}
            self._monitored = [b for b in self.fleet if b.thermal is not None]
            self._last_tier = {k: v for k, v in self._last_tier.items() if k in self._domain_of}
            self._version = self.fleet.version

    @property
    def domain_of(self) -> dict[str, str | None]:
        """Each backend's power domain by id (None: none), as the fleet is now."""
        self._follow()
        return self._domain_of

    @property
    def monitored(self) -> list[Backend]:
        """The backends with GPU telemetry, as the fleet is now."""
        self._follow()
        return self._monitored

    # ---- the loop ------------------------------------------------------------------------
    async def round(self) -> None:
        """One GPU telemetry round: scrape all, rebuild the view, apply triggers."""
        await asyncio.gather(*(self.scrape_one(b) for b in self.monitored))
        self.refresh()
        if self.clocks is not None and self.cfg.enabled:
            await self.clocks.step(self.monitored, self.view)
        self.apply_triggers()

    def refresh(self) -> None:
        """Rebuild the view from the trackers now; count backends that turned unknown."""
        now = self.clock()
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
        trackers = {b.id: b.thermal for b in self.fleet}
        return build_view(now, trackers, self.domain_of, self.budgets_w, self.cfg)

    async def scrape_one(self, backend: Backend) -> None:
        """Scrape ``backend``'s GPU telemetry once: its trackers observe the sample; a new
        Xid burst or ECC DBE is a GPU fault (:meth:`gpu_fault`); each GPU's utilization and
        framebuffer memory are exported (:meth:`GatewayMetrics.observe_gpus`). A failure is
        counted (``gateway_gpu_scrape_errors_total``), kept as the backend's GPU error, and
        drops those per-GPU gauges (no stale value)."""
        url = str(backend.config.gpu_metrics_url)
        tracker, health = backend.thermal, backend.gpu_health
        assert tracker is not None and health is not None, "not a monitored backend"
        try:
            sample = await scrape_gpus(
                self.client(),
                url,
                self.clock,
                backend.config.gpu_indices,
                timeout_s=self.cfg.scrape_timeout_s,
            )
        except (httpx.HTTPError, ValueError) as e:
            backend.gpu_scrape_result(failure_detail("GPU metrics", e))
            self.metrics.gpu_scrape_errors.labels(backend.id).inc()
            self.metrics.forget_gpus(backend.id)
            return
        backend.gpu_scrape_result(None)
        tracker.observe(sample)
        self.metrics.observe_gpus(backend.id, sample.readings)
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
        now = self.clock()
        for b in self.monitored:
            st = self.view.status(b.id, now)
            if not cooldown_due(b.state, st, self.cfg) or self.busy(b):
                continue
            if self.clocks is not None and not self.clocks.clocks_exhausted([b.id]):
                continue  # clocks first: capped, not drained, until its cap is at the floor
            if self.request_cooldown(b.id, "thermal", rest_done=self.rest_done(b)):
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

    def rest_done(self, backend: Backend) -> RestDone:
        """The end condition of ``backend``'s thermal rest (argument: seconds rested)."""
        tracker = backend.thermal
        assert tracker is not None, "not a monitored backend"

        def done(rested_s: float) -> bool:  # the cap may release it between 70 and 85 °C
            return rest_over(tracker, rested_s, self.clock(), self.cfg)

        return done

    def scheduled_rest_done(self, backend: Backend) -> RestDone | None:
        """The end condition of a *scheduled* medium cycle's rest on ``backend`` (argument:
        seconds rested), or None without GPU telemetry (then the fixed
        ``lifecycle.medium.cooldown_s`` applies): the rest lasts as long as the GPU needs and
        no longer, so it ends at the first fresh reading below ``resume_c`` (at once when the
        GPU is already cool), at ``max_cooldown_s`` at most; while telemetry is stale or
        reads no temperature, after ``lifecycle.medium.cooldown_s`` as without it."""
        tracker = backend.thermal
        if tracker is None or not self.cfg.enabled:
            return None
        fallback_s = self.medium_cooldown_s

        def done(rested_s: float) -> bool:
            if rested_s >= self.cfg.max_cooldown_s:
                return True
            s = tracker.latest
            if not tracker.fresh(self.clock()) or s is None or s.temp_c is None:
                return rested_s >= fallback_s  # no temperature to wait for
            return s.temp_c < self.cfg.resume_c

        return done

    # ---- GPU health breaker -------------------------------------------------------------------
    def gpu_fault(self, backend: Backend, reason: str, xid_last: tuple[int, ...]) -> None:
        """New Xid burst or ECC DBE: noted, logged, then the ``gpu_fault`` callback
        (``unhealthy`` now, then the restart hook)."""
        what = (
            f"{self.cfg.xid_threshold} or more new Xid errors within "
            f"{self.cfg.xid_window_s:g} s (last codes {list(xid_last)})"
            if reason == "gpu_xid"
            else "a new double-bit ECC error"
        )
        backend.note_error(f"GPU fault: {what}")
        log.error("backend %s: GPU fault (%s): %s", backend.id, reason, what)
        self.on_fault(backend, reason)

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
        level = power_pressure((self.domain_of.get(b.id) for b in candidates), view.domains)
        if self.clocks is None:
            return level
        return self.clocks.gate.level(level, self.clocks.exhausted([b.id for b in candidates]))
