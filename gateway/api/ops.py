"""Operations surface: ``/health`` (process alive), ``/ready`` (can serve), ``/metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

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
    """200 when at least one backend is routable and the gateway is not shutting down.

    In fleet mode the body adds ``coordination`` (:func:`coordination_detail`), which never
    makes the replica not ready: while the store is down requests still flow on the local
    share, so a load balancer must keep sending them here."""
    gw = _gateway(request)
    routable = [b.id for b in gw.fleet.backends if b.routable]
    extra = {} if gw.coord is None else {"coordination": coordination_detail(gw)}
    if gw.shutting_down:
        return JSONResponse(
            {"status": "shutting_down", "routable": routable, **extra}, status_code=503
        )
    if not routable:
        return JSONResponse(
            {"status": "no_routable_backend", "routable": [], **extra}, status_code=503
        )
    return JSONResponse({"status": "ready", "routable": routable, **extra})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the gateway's own registry."""
    return Response(
        generate_latest(_gateway(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def install_routes(app: FastAPI) -> None:
    """Register ``/health``, ``/ready`` and ``/metrics`` on ``app``."""
    for path, fn in (("/health", health), ("/ready", ready), ("/metrics", metrics)):
        app.add_api_route(path, fn, methods=["GET", "HEAD"], include_in_schema=False)
