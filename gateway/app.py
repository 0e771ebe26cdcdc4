"""FastAPI app factory and lifespan: builds the components, starts and stops control loops.

Everything mutable (fleet state, metrics registry, pools, loops) is created inside the
lifespan and hangs off ``app.state.gateway``; nothing lives in module globals.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from gateway.api import admin, ops
from gateway.api import openai as openai_api
from gateway.api.errors import SERVER_ERROR, error_response, install_error_handlers
from gateway.batching import ArrivalForecasts, BatchDispatcher, forecast_params
from gateway.config import ClientKey, GatewayConfig
from gateway.fleet.backend import Fleet
from gateway.fleet.controller import FleetController
from gateway.gate import AdmissionGate
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.proxy.upstream import UpstreamPool
from gateway.routing.policy import AffinityTable, Router

log = logging.getLogger("gateway.app")


@dataclass
class Gateway:
    """The live components of one gateway (one per app)."""

    cfg: GatewayConfig
    fleet: Fleet
    metrics: GatewayMetrics
    router: Router
    pool: UpstreamPool
    controller: FleetController
    pipeline: Pipeline
    gate: AdmissionGate
    client_keys: dict[str, ClientKey]
    admin_key: str | None
    shutting_down: bool = False
    # requests still receiving their body (their tasks), and whether the shutdown's grace
    # period ended for them (then they are answered 503 without the rest of the body)
    uploading: set[asyncio.Task[Any]] = field(default_factory=set)
    uploads_cut: bool = False
    forecasts: ArrivalForecasts | None = None  # arrival counts and forecasts (cfg.forecast)
    batching: BatchDispatcher | None = None  # the predictive batcher (cfg.batcher)

    @property
    def header_keys(self) -> tuple[bytes, bytes, bytes]:
        """Lower-case names of the request-id, session and priority headers (raw ASGI)."""
        return (
            self.cfg.server.request_id_header.lower().encode("latin-1"),
            self.cfg.routing.session_header.lower().encode("latin-1"),
            self.cfg.admission.priority_header.lower().encode("latin-1"),
        )


def build_gateway(cfg: GatewayConfig) -> Gateway:
    """Wire the components for ``cfg`` (no I/O; the lifespan starts the loops)."""
    clock = time.monotonic
    fleet = Fleet.from_config(cfg, clock)
    metrics = GatewayMetrics()
    metrics.attach_fleet(fleet)
    r = cfg.routing
    router = Router(
        r.weights,
        cfg.telemetry.stale_after_s,
        AffinityTable(r.session_ttl_s, r.session_max_entries, clock),
        clock,
        slow_start_s=cfg.lifecycle.slow_start_s,
        slow_start_min_weight=cfg.lifecycle.slow_start_min_weight,
    )
    pool = UpstreamPool(cfg.proxy)
    controller = FleetController(cfg, fleet, metrics, clock=clock)
    if cfg.thermal.enabled and (controller.gpu.monitored or cfg.power_domains):
        router.thermal = controller.gpu.choose  # thermal tiers, power caps and budgets
    gate = AdmissionGate(cfg, fleet, metrics, clock)
    if cfg.thermal.enabled and cfg.power_domains:
        gate.power_level = controller.gpu.power_level
    pipeline = Pipeline(cfg, fleet, router, pool, controller, metrics, gate)
    keys = {k.resolve(): k for k in cfg.auth.client_keys}
    batching = (
        BatchDispatcher(cfg, pipeline, router, gate, metrics, clock)
        if cfg.batcher.enabled
        else None
    )
    forecasts = None
    if cfg.forecast.enabled or batching is not None:

        def slack() -> float | None:
            p99 = pipeline.p99_ttft(30.0)
            return cfg.slo.ttft_s - (p99 if p99 is not None else 0.0)

        forecasts = ArrivalForecasts(
            forecast_params(cfg), metrics, batching.core if batching else None, slack
        )
        # read before a cycle takes a backend out
        controller.maintenance.use_forecast(forecasts.rate_rps)
    return Gateway(
        cfg=cfg,
        fleet=fleet,
        metrics=metrics,
        router=router,
        pool=pool,
        controller=controller,
        pipeline=pipeline,
        gate=gate,
        client_keys=keys,
        admin_key=cfg.auth.resolved_admin_key(),
        forecasts=forecasts,
        batching=batching,
    )


def check_secrets(cfg: GatewayConfig) -> None:
    """Resolve every key once so a missing env var fails at start (``ConfigError``)."""
    for k in cfg.auth.client_keys:
        k.resolve()
    cfg.auth.resolved_admin_key()
    for b in cfg.backends:
        b.resolved_api_key()


class GatewayApp:
    """The ASGI app: model requests take a direct path, everything else goes to FastAPI.

    ``POST`` to the model routes (chat, completions, embeddings, the vLLM pass-through
    routes) is the data path, so it skips the framework's routing, dependency injection
    and middleware layers: measured on this machine kind they cost about 0.1 ms of CPU per
    request, a third of a bare pass-through's whole budget (benchmarks/proxy_overhead.py).
    The same handler serves the FastAPI routes, so behaviour is identical either way;
    unexpected errors still become an OpenAI-shaped 500. Attribute access falls through to
    the FastAPI app (``app.state``, ``app.routes``, ...).
    """

    def __init__(self, app: FastAPI, hot_paths: set[str]) -> None:
        self.app = app
        self.hot_paths = frozenset(hot_paths)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in self.hot_paths
            and scope["method"] == "POST"
        ):
            scope["app"] = self.app
            started = time.perf_counter()
            try:
                response = await openai_api.model_response(self.app.state.gateway, scope, receive)
            except Exception as e:
                log.exception("unexpected error on %s", scope["path"])
                response = error_response(
                    500,
                    f"Internal gateway error: {type(e).__name__}",
                    SERVER_ERROR,
                    "internal_error",
                )
                gw = getattr(self.app.state, "gateway", None)
                if gw is not None:  # counted and timed like every answered request
                    openai_api.answered(gw.metrics, scope["path"], "", 500, started)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(cfg: GatewayConfig) -> GatewayApp:
    """The gateway's ASGI app for ``cfg``. Raises ``ConfigError`` for unresolvable secrets."""
    check_secrets(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = build_gateway(cfg)
        app.state.gateway = gw
        await gw.controller.start()
        if gw.gate.degraded is not None:

            async def degraded_tick() -> None:
                gw.gate.tick(gw.pipeline.p99_ttft(cfg.degraded.window_s))

            gw.controller.add_loop("degraded_mode", cfg.degraded.tick_s, degraded_tick)
        forecasts = gw.forecasts
        if forecasts is not None:

            async def forecast_tick() -> None:
                forecasts.tick(float(int(gw.controller.wall())))

            gw.controller.add_loop("forecast", 1.0, forecast_tick)
        try:
            yield
        finally:
            gw.shutting_down = True
            await gw.controller.stop()
            if gw.batching is not None:
                await gw.batching.close()
            await gw.pool.close()

    kwargs: dict[str, object] = dict(
        title="llm-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    try:  # FastAPI >= 0.16x wraps every request in OpenTelemetry hooks unless told not to
        app = FastAPI(**kwargs, telemetry={"tracing": False, "metrics": False, "logs": False})
    except TypeError:
        app = FastAPI(**kwargs)
    install_error_handlers(app)
    openai_api.install_routes(app, cfg.proxy.passthrough_paths)
    ops.install_routes(app)
    admin.install_routes(app)
    return GatewayApp(app, set(openai_api.MODEL_ROUTES) | set(cfg.proxy.passthrough_paths))
