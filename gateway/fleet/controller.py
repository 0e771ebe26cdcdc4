"""The fleet's control loops: health probes, load scrapes, model discovery.

I/O lives here; every decision comes from the pure rules of
:mod:`gateway.fleet.lifecycle`. Each loop survives its own exceptions (logged, counted in
``gateway_loop_errors_total``) and exports its last success time
(``gateway_loop_last_success_timestamp_seconds{loop}``). The request path reports traffic
outcomes through :meth:`FleetController.on_traffic` (passive outlier detection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from gateway.config import GatewayConfig
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend, BackendState, Fleet
from gateway.fleet.probes import fetch_models, probe_health
from gateway.fleet.telemetry import scrape_load
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


class FleetController:
    """Runs the control loops over ``fleet`` and applies lifecycle decisions.

    ``clock`` is monotonic seconds (load samples, rate limits); ``wall`` is unix seconds
    (transition history shown to operators).
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
        self.api_keys = {b.id: b.config.resolved_api_key() for b in fleet}
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._warming: dict[str, asyncio.Task[None]] = {}
        self._last_models_refresh = float("-inf")
        self._models_lock = asyncio.Lock()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "controller not started"
        return self._client

    # ---- start / stop -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the control-plane client, run one probe round, then start the loops.

        The first round is bounded by the probe timeout, so a healthy fleet is routable as
        soon as the gateway accepts traffic and a dead one never blocks start-up.
        """
        h = self.cfg.health
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(h.timeout_s),
            limits=httpx.Limits(max_connections=max(16, 4 * len(self.fleet))),
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(h.timeout_s + 1.0):
                await self.probe_round()
                if self._warming:
                    await asyncio.gather(*self._warming.values(), return_exceptions=True)
        t = self.cfg.telemetry
        self._tasks = [
            asyncio.create_task(self._loop("probe", h.interval_s, self.probe_round)),
            asyncio.create_task(self._loop("scrape", t.scrape_interval_s, self.scrape_round)),
            asyncio.create_task(self._loop("models", t.models_refresh_s, self.models_round)),
        ]

    async def stop(self) -> None:
        tasks = self._tasks + list(self._warming.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._warming = [], {}
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self, name: str, interval: float, body: Callable[[], Awaitable[None]]) -> None:
        gauge = self.metrics.loop_last_success.labels(name)
        errors = self.metrics.loop_errors.labels(name)
        while True:
            try:
                await body()
                gauge.set(self.wall())
            except asyncio.CancelledError:
                raise
            except Exception:
                errors.inc()
                log.exception("control loop %s failed; continuing", name)
            await asyncio.sleep(interval)

    # ---- transitions --------------------------------------------------------------------
    def transition(self, backend: Backend, to: BackendState, reason: str) -> None:
        """Apply one checked transition, log it and count it."""
        if backend.state is to:
            return
        t = lifecycle.apply_transition(backend, to, reason, self.wall())
        level = logging.WARNING if to is BackendState.UNHEALTHY else logging.INFO
        log.log(level, "backend %s: %s -> %s (%s)", backend.id, t.from_state, to, reason)
        self.metrics.transitions.labels(backend.id, t.from_state.value, to.value, reason).inc()
        if to is BackendState.WARMING:
            self._start_warming(backend)

    def apply(self, backend: Backend, decision: lifecycle.Decision | None) -> None:
        if decision is not None:
            self.transition(backend, decision.to, decision.reason)

    def on_traffic(self, backend: Backend, failed: bool) -> None:
        """Passive outlier detection: one real request's outcome on ``backend``."""
        self.apply(backend, lifecycle.after_traffic(backend, failed, self.cfg.health))

    def _start_warming(self, backend: Backend) -> None:
        task = self._warming.get(backend.id)
        if task is not None and not task.done():
            return
        self._warming[backend.id] = asyncio.get_running_loop().create_task(self._warm(backend))

    async def _warm(self, backend: Backend) -> None:
        """Bring a ``warming`` backend to ``warm``: it must list its models first."""
        await self.refresh_models(backend)
        if backend.state is BackendState.WARMING and backend.models:
            self.transition(backend, BackendState.WARM, "ready")

    # ---- probes ---------------------------------------------------------------------------
    def _config_error(self, backend: Backend, detail: str, status: int | None) -> None:
        self.metrics.backend_config_errors.labels(backend.id, str(status)).inc()
        if backend.config_error != detail:
            log.error(
                "CONFIGURATION ERROR: backend %s rejected the gateway's credentials (%s); "
                "check backends[%s].api_key / api_key_env",
                backend.id,
                detail,
                backend.id,
            )
        backend.config_error = detail

    async def probe_round(self) -> None:
        await asyncio.gather(*(self.probe_one(b) for b in self.fleet))

    async def probe_one(self, backend: Backend) -> None:
        res = await probe_health(self.client, backend, self.api_keys[backend.id])
        self.metrics.probe_results.labels(backend.id, res.status).inc()
        if res.status == "auth":
            # Alive, but refusing our key: a gateway misconfiguration, never "dead".
            self._config_error(backend, res.detail, res.http_status)
            ok = True
        else:
            ok = res.status == "ok"
            if not ok:
                backend.note_error(res.detail)
        self.apply(backend, lifecycle.after_probe(backend, ok, self.cfg.health))
        if ok and backend.state is BackendState.WARMING:
            self._start_warming(backend)

    # ---- load scrapes ---------------------------------------------------------------------
    async def scrape_round(self) -> None:
        await asyncio.gather(
            *(self.scrape_one(b) for b in self.fleet if b.state is not BackendState.COLD)
        )

    async def scrape_one(self, backend: Backend) -> None:
        try:
            backend.load = await scrape_load(
                self.client, backend, self.api_keys[backend.id], self.clock
            )
            backend.last_scrape_ok_at = self.clock()
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.scrape_errors.labels(backend.id).inc()
            backend.note_error(f"scrape: {type(e).__name__}: {e}".rstrip(": "))

    # ---- model discovery ------------------------------------------------------------------
    async def models_round(self) -> None:
        self._last_models_refresh = self.clock()
        await asyncio.gather(
            *(self.refresh_models(b) for b in self.fleet if b.state is not BackendState.COLD)
        )

    async def refresh_models(self, backend: Backend) -> None:
        """Learn what ``backend`` serves from its ``/v1/models`` (unless set in config)."""
        res = await fetch_models(self.client, backend, self.api_keys[backend.id])
        if res.status == "auth":
            self._config_error(backend, res.detail, res.http_status)
            return
        if res.cards is None:
            backend.note_error(res.detail)
            return
        if backend.config_error and res.status == "ok":
            backend.config_error = None
        backend.model_cards = res.cards
        if backend.config.models is None:
            backend.models = tuple(c.id for c in res.cards)

    async def refresh_models_soon(self, min_interval_s: float = 1.0) -> None:
        """Refresh every backend's model list now, at most once per ``min_interval_s``.

        Used when a request names a model nobody lists (a LoRA adapter just loaded).
        """
        async with self._models_lock:
            if self.clock() - self._last_models_refresh < min_interval_s:
                return
            await self.models_round()
