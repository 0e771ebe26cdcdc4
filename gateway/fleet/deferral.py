"""Deferral of due maintenance cycles: a cycle that takes a backend out waits while the other
backends could not carry the load (:func:`gateway.fleet.lifecycle.can_carry_without`, fed
:meth:`Deferrals.demand`) or while a rollout needs the backend
(:func:`gateway.fleet.lifecycle.rollout_hold`); it is skipped until its next period after
``lifecycle.max_defer_s``. Each deferral is shown on the backend's control record
(:class:`gateway.fleet.records.Deferral`) and counted in ``gateway_maintenance_deferrals_total``,
``gateway_maintenance_deferred`` and ``gateway_maintenance_deferral_seconds``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import CycleKind, cycle_started
from gateway.fleet.fleet import Fleet
from gateway.fleet.records import Deferral
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


class Deferrals:
    """The deferrals of ``fleet``'s due cycles under ``cfg`` (``lifecycle.max_defer_s``,
    seconds), recorded through ``state`` and counted in ``metrics``."""

    def __init__(
        self, cfg: GatewayConfig, fleet: Fleet, state: FleetState, metrics: GatewayMetrics
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.state = state
        self.metrics = metrics
        self._forecast_rps: Callable[[str], float | None] | None = None

    def use_forecast(self, forecast_rps: Callable[[str], float | None]) -> None:
        """Read ``forecast_rps`` (requests/s forecast for a model) in :meth:`demand`."""
        self._forecast_rps = forecast_rps

    def left_rotation(self) -> None:
        """Drop the deferral of every backend that left rotation another way (not warm)."""
        for b in self.fleet:
            if b.deferred is not None and b.state is not BackendState.WARM:
                self.state.set_deferral(b, None)
                self.metrics.cycle_deferred.labels(b.id).set(0)

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

    def defer(self, b: Backend, kind: CycleKind, why: str, now: float) -> None:
        """Hold ``b``'s due ``kind`` cycle back at monotonic ``now`` (``why``: the others
        cannot carry the load, or a rollout holds it); after
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

    def end(self, b: Backend, now: float) -> None:
        """The deferred cycle of ``b`` starts at monotonic ``now``: its deferral ends (the
        seconds it waited go to ``gateway_maintenance_deferral_seconds``)."""
        if b.deferred is not None:
            log.info(
                "backend %s: %s cycle starts after %.0f s deferred",
                b.id, b.deferred.cycle, now - b.deferred.since,
            )
            self.metrics.cycle_deferral_seconds.observe(now - b.deferred.since)
            self.state.set_deferral(b, None)
            self.metrics.cycle_deferred.labels(b.id).set(0)
