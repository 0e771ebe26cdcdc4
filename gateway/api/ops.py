"""Operations surface: ``/health`` (process alive), ``/ready`` (can serve), ``/metrics``."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


async def ready(request: Request) -> Response:
    """200 when at least one backend is routable and the gateway is not shutting down."""
    gw = _gateway(request)
    routable = [b.id for b in gw.fleet.backends if b.routable]
    if gw.shutting_down:
        return JSONResponse({"status": "shutting_down", "routable": routable}, status_code=503)
    if not routable:
        return JSONResponse({"status": "no_routable_backend", "routable": []}, status_code=503)
    return JSONResponse({"status": "ready", "routable": routable})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the gateway's own registry."""
    return Response(
        generate_latest(_gateway(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def install_routes(app: FastAPI) -> None:
    """Register ``/health``, ``/ready`` and ``/metrics`` on ``app``."""
    for path, fn in (("/health", health), ("/ready", ready), ("/metrics", metrics)):
        app.add_api_route(path, fn, methods=["GET", "HEAD"], include_in_schema=False)
