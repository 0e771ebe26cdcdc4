"""The load-scrape loop: each backend's vLLM ``/metrics`` every
``telemetry.scrape_interval_s``, recorded on the backend (its load sample and service
model, :meth:`gateway.fleet.backend.Backend.scraped`). Parsing is
:mod:`gateway.fleet.telemetry`'s (pure); this module does the rounds and what a scrape
tells the lifecycle: a new server process after a restart hook ends the ``restarting``
hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from gateway.config import TelemetryConfig
from gateway.core.urls import failure_detail
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.clients import ControlClients
from gateway.fleet.fleet import Fleet
from gateway.fleet.state import FleetState
from gateway.fleet.telemetry import scrape_load
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


class LoadScraper:
    """Scrapes ``fleet``'s backends (``clock``: monotonic seconds)."""

    def __init__(
        self,
        fleet: Fleet,
        state: FleetState,
        clients: ControlClients,
        metrics: GatewayMetrics,
        cfg: TelemetryConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.state = state
        self.clients = clients
        self.metrics = metrics
        self.cfg = cfg
        self.clock = clock

    async def scrape_round(self) -> None:
        """The scrape loop's body: every backend that is not ``cold`` (or is restarting),
        concurrently."""
        await asyncio.gather(
            *(
                self.scrape_one(b)
                for b in self.fleet
                if b.state is not BackendState.COLD or b.hold == "restarting"
            )
        )

    async def scrape_one(self, backend: Backend) -> None:
        """Scrape ``backend`` once; a failure is counted (``gateway_scrape_errors_total``)
        and noted in its last error."""
        try:
            load = await scrape_load(
                self.clients.control,
                backend,
                backend.api_key,
                self.clock,
                self.cfg.scrape_timeout_s,
            )
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.scrape_errors.labels(backend.id).inc()
            backend.note_error(failure_detail("scrape", e))
            return
        backend.scraped(load, self.clock())
        started = load.process_start_s
        if (
            backend.hold == "restarting"
            and started is not None
            and backend.restart_seen_after is not None
            and started != backend.restart_seen_after
        ):
            log.info("backend %s: restart seen (a new server process); hold over", backend.id)
            self.state.release_hold(backend, restart_seen=True)
