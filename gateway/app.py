"""FastAPI app factory and lifespan: builds the components (:mod:`gateway.wiring`), starts
and stops the control loops, and routes model requests past the framework.

Everything mutable (fleet state, metrics registry, pools, loops) is created inside the
lifespan and hangs off ``app.state.gateway``; nothing lives in module globals.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from gateway.api import admin, autoscale, config_admin, ops, rollouts, status, zones
from gateway.api import openai as openai_api
from gateway.api import responses as responses_api
from gateway.api.access import admin_refusal, body_type_refusal, is_admin_path
from gateway.api.errors import install_error_handlers, render
from gateway.config import GatewayConfig, check_secrets
from gateway.config_history import ConfigHistory
from gateway.fleet.discovery import DiscoverySource
from gateway.flow.responses import RESPONSES
from gateway.flow.rollout_probes import PROBE_TICK_S
from gateway.flow.rollouts import TICK_S as ROLLOUT_TICK_S
from gateway.proxy.upstream import Transport
from gateway.reload_errors import ReloadRefused
from gateway.reload_fleet import FleetReload
from gateway.reloading import Reloader
from gateway.signals import gateway_version
from gateway.wiring import Gateway, build_gateway

log = logging.getLogger("gateway.app")


class GatewayApp:
    """The ASGI app: model requests take a direct path, everything else goes to FastAPI.

    ``POST`` to the model routes (chat, completions, embeddings, the audio uploads, the
    vLLM pass-through routes) is the data path, so it skips the framework's routing,
    dependency injection and middleware layers: measured on this machine kind they cost
    about 0.1 ms of CPU per request, a third of a bare pass-through's whole budget
    (benchmarks/proxy_overhead.py). The same handler serves the FastAPI routes, so
    behaviour is identical either way; unexpected errors still become an OpenAI-shaped 500.
    Every path under ``/admin`` is checked first (:func:`gateway.api.access.admin_refusal`:
    the admin key, else loopback only), so no admin route can be added unguarded.
    Attribute access falls through to the FastAPI app (``app.state``, ``app.routes``, ...).
    """

    def __init__(self, app: FastAPI, hot_paths: set[str]) -> None:
        self.app = app
        self.hot_paths = frozenset(hot_paths)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_admin_path(scope["path"]):
            # every /admin route, before any runs (gateway.api.access)
            refusal = (admin_refusal(self.app.state.gateway.admin_key, scope)
                       or body_type_refusal(scope))
            if refusal is not None:
                await render(refusal)(scope, receive, send)
                return
        if (
            scope["type"] == "http"
            and scope["path"] in self.hot_paths
            and scope["method"] == "POST"
        ):
            scope["app"] = self.app
            await openai_api.serve(self.app.state.gateway, scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    cfg: GatewayConfig,
    transport: Transport | None = None,
    source: DiscoverySource | None = None,
    config_path: str | Path | None = None,
    server_overrides: dict[str, object] | None = None,
) -> GatewayApp:
    """The gateway's ASGI app for ``cfg``. ``transport``: how upstream requests are sent
    (default: the aiohttp pool; tests pass an in-process one); ``source``: the discovery
    source (default: the one ``cfg.discovery`` names); ``config_path``: the file ``cfg``
    came from (what ``SIGHUP`` and ``reload.watch`` read again; None: none);
    ``server_overrides``: the command line's ``server`` settings (``--host``, ``--port``),
    applied again over every reloaded config. Raises
    ``ConfigError`` for unresolvable secrets (a stand-in ``source`` needs no Kubernetes
    credentials) and ``OSError`` for a ``reload.state_dir`` that cannot be made."""
    check_secrets(cfg, discovery_credentials=source is None)
    history = ConfigHistory(cfg.reload.state_dir, cfg.reload.keep)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = build_gateway(cfg, transport, source)
        app.state.gateway = gw
        if gw.admin_key is None:
            log.info("no admin key (auth.admin_key_file / auth.admin_key_env): /admin/* "
                     "answers loopback clients only")
        gw.reloader = Reloader(gw, history, config_path, wall=gw.controller.wall,
                               server_overrides=server_overrides)
        gw.reloader.start()
        if gw.coord is not None:  # fleet mode: one config for the fleet (coord.config_sync)
            gw.reloader.join_fleet(FleetReload(gw.reloader, gw.coord.share_config()))
        gw.reloader.restore_at_start("backends")  # a restart: kept baselines and holds
        if gw.coord is not None:
            await gw.coord.connect()  # fleet mode: the shared store before the loops
        await gw.controller.start()
        if cfg.discovery.dynamic:  # backends come and go: the source's task
            gw.controller.membership.start(gw.discovery)
        if gw.coord is not None:
            gw.coord.start_loops(gw.controller)
        if gw.gate.degraded is not None:

            async def degraded_tick() -> None:
                gw.gate.tick(gw.accounting.p99_ttft(cfg.degraded.window_s))

            gw.controller.add_loop("degraded_mode", cfg.degraded.tick_s, degraded_tick)
        forecasts = gw.forecasts
        if forecasts is not None:

            async def forecast_tick() -> None:
                forecasts.tick(float(int(gw.controller.wall())))

            gw.controller.add_loop("forecast", 1.0, forecast_tick)
        if gw.autoscaling is not None:  # desired replicas per model (GET /autoscale)
            gw.controller.add_loop("autoscale", cfg.autoscale.interval_s, gw.autoscaling.round)
        if cfg.reload.watch and config_path is not None:  # the config file, re-read on change
            gw.controller.add_loop("config_watch", cfg.reload.watch_interval_s,
                                   gw.reloader.watch_round)
        # a restart: ended rollouts and rollouts where they were, then the config's entries
        gw.reloader.restore_at_start("rollouts")
        _start_rollouts(gw)
        if gw.status is not None:  # the status page's per-minute hour and incidents
            gw.controller.add_loop("status", cfg.status.tick_s, gw.status.round)
        if cfg.reload.state_dir is not None:
            reloader = gw.reloader

            async def checkpoint() -> None:
                reloader.checkpoint()

            gw.controller.add_loop("config_checkpoint", cfg.reload.checkpoint_s, checkpoint)
        try:
            yield
        finally:
            gw.shutting_down = True
            gw.reloader.checkpoint()  # the state a restart takes up
            await gw.controller.stop()
            if gw.coord is not None:
                await gw.coord.stop()
            if gw.batching is not None:
                await gw.batching.close()
            await gw.transport.close()

    try:  # FastAPI >= 0.16x wraps every request in OpenTelemetry hooks unless told not to
        app = FastAPI(
            title="llm-gateway",
            version=gateway_version(),  # not FastAPI's default "0.1.0"
            lifespan=lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            telemetry={"tracing": False, "metrics": False, "logs": False},
        )
    except TypeError:  # an older FastAPI without the argument
        app = FastAPI(
            title="llm-gateway", version=gateway_version(), lifespan=lifespan, docs_url=None,
            redoc_url=None, openapi_url=None,
        )
    install_error_handlers(app)
    openai_api.install_routes(app, cfg.proxy.passthrough_paths)
    if RESPONSES in cfg.proxy.passthrough_paths:  # the Responses API's calls by response id
        responses_api.install_routes(app)
    ops.install_routes(app)
    autoscale.install_routes(app)
    admin.install_routes(app)
    admin.install_fleet_route(app)
    config_admin.install_routes(app)
    rollouts.install_routes(app)
    zones.install_routes(app)
    status.install_routes(app)
    return GatewayApp(app, set(openai_api.SERVED_ROUTES) | set(cfg.proxy.passthrough_paths))


def _start_rollouts(gw: Gateway) -> None:
    """Start the config's canary rollouts, their loops (decisions, calibration probes) and
    the config's return when a rollout from the config rolls back: to the kept snapshot
    before the version that started it (:mod:`gateway.flow.rollouts`)."""
    rollouts, reloader = gw.rollouts, gw.reloader
    assert rollouts is not None and reloader is not None and gw.rollout_probes is not None
    last = reloader.history.last

    async def return_config(started_in: int | None, reason: str,
                            failed: dict[str, Any]) -> None:
        target = None  # the config before the running one
        try:
            if started_in is not None:  # kept: the fleet's in fleet mode
                before = [s.version for s in await reloader.kept() if s.version < started_in]
                if not before:
                    log.error("rollout rolled back (%s): no config before version %d is "
                              "kept; the config stays as it is", reason, started_in)
                    return
                target = before[-1]
            result = await reloader.rollback(target, failed)
        except ReloadRefused as e:
            log.error("rollout rolled back (%s): the config was not returned: %s", reason,
                      e.problem)
            return
        log.warning("rollout rolled back (%s): config returned to version %s (now version "
                    "%s)", reason, target if target is not None else "before the running one",
                    result.snapshot.version if result.snapshot else "unchanged")

    rollouts.on_config_rollback = return_config
    rollouts.sync(gw.cfg.rollouts, last.version if last is not None else None)
    gw.controller.add_loop("rollouts", ROLLOUT_TICK_S, rollouts.round)
    # a round waits on generations (6 short greedy answers): not a stall below 10 minutes
    gw.controller.add_loop("rollout_probes", PROBE_TICK_S, gw.rollout_probes.round,
                           stall_after_s=600.0)
