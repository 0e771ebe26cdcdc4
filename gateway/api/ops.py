"""Operations surface: ``/health`` (liveness), ``/ready`` (the gateway's own readiness),
``/ready/fleet`` (the backends, for dashboards), ``/metrics``.

``/ready`` says whether *this gateway* can take requests: its readiness checks pass
(:mod:`gateway.core.readiness`: control loops running, the shared store reached once in
fleet mode, discovery synced where a source registers it) and it is not shutting down. It
says nothing about the backends: with none routable the gateway still answers every model
request itself (503 with ``retry-after``, OpenAI-shaped), which a client can act on, so a
load balancer must keep sending here. The fleet's state is ``/ready/fleet``'s.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from gateway.signals import exposition

if TYPE_CHECKING:
    from gateway.wiring import Gateway


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway  # starlette's State holds untyped attributes
    return gw


async def health() -> Response:
    """200 while the process runs (liveness); says nothing about backends."""
    return JSONResponse({"status": "ok"})


def coordination_detail(gw: Gateway) -> dict[str, Any]:
    """The shared store as this replica sees it (fleet mode only): ``up``, ``fallback``
    (running on the local share), ``reason`` (why, while it does not answer),
    ``down_for_s``. Read from memory: no store call."""
    assert gw.coord is not None
    link = gw.coord.link
    return {
        "replica_id": link.replica_id,
        "up": link.up,
        "fallback": link.fallback,
        "reason": link.reason or None,
        "down_for_s": round(link.down_for_s(), 3),
    }


async def ready(request: Request) -> Response:
    """The gateway's own readiness (a Kubernetes readiness probe, a load balancer's check).

    200 ``{"status": "ready", "checks": {name: {"ok", "detail"}}}`` when every readiness
    check passes; 503 ``"not_ready"`` (the same ``checks``, ``failing``: their names) when
    one does not; 503 ``"shutting_down"`` once SIGTERM arrived. Backends do not count: an
    empty or all-down fleet is answered by the gateway itself (``/ready/fleet`` shows it).
    In fleet mode the body adds ``coordination`` (:func:`coordination_detail`); a store
    outage after start never makes the replica not ready (requests still flow on the local
    share)."""
    gw = _gateway(request)
    report = gw.readiness.report()
    body: dict[str, Any] = {
        "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in report.checks}
    }
    if gw.coord is not None:
        body["coordination"] = coordination_detail(gw)
    if gw.shutting_down:
        return JSONResponse({"status": "shutting_down", **body}, status_code=503)
    if not report.ready:
        failing = [c.name for c in report.failing]
        return JSONResponse({"status": "not_ready", "failing": failing, **body}, status_code=503)
    return JSONResponse({"status": "ready", **body})


async def ready_fleet(request: Request) -> Response:
    """The fleet as this gateway sees it, for dashboards and scripts (not a probe).

    200 when at least one backend is routable (warm, its circuit breaker not open), else
    503; the body: ``status`` (``routable`` | ``no_routable_backend``), ``routable``
    (backend ids, config order), ``backends`` (how many), ``states`` (backends per serving
    state: the lifecycle state, or ``breaker_open`` for a warm one with its breaker open,
    :func:`gateway.core.vocab.serving_state`) and ``models`` (per model id: ``backends``
    serving it, ``routable`` of them). Read from memory."""
    gw = _gateway(request)
    backends = gw.fleet.backends
    routable = [b.id for b in backends if b.routable]
    models: dict[str, dict[str, int]] = {}
    for b in backends:
        for m in b.models:
            entry = models.setdefault(m, {"backends": 0, "routable": 0})
            entry["backends"] += 1
            entry["routable"] += int(b.routable)
    body = {
        "status": "routable" if routable else "no_routable_backend",
        "routable": routable,
        "backends": len(backends),
        "states": dict(Counter(b.serving_state for b in backends)),
        "models": models,
    }
    return JSONResponse(body, status_code=200 if routable else 503)


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the gateway's own registry, without ``_created``
    series (:func:`gateway.signals.exposition`)."""
    return Response(exposition(_gateway(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def install_routes(app: FastAPI) -> None:
    """Register ``/health``, ``/ready``, ``/ready/fleet`` and ``/metrics`` on ``app``."""
    routes = (
        ("/health", health),
        ("/ready", ready),
        ("/ready/fleet", ready_fleet),
        ("/metrics", metrics),
    )
    for path, fn in routes:
        app.add_api_route(path, fn, methods=["GET", "HEAD"], include_in_schema=False)
