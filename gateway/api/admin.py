"""Admin surface (``/admin/...``): what the gateway knows about each backend.

Guarded by ``auth.admin_key`` when configured (``Authorization: Bearer <key>``).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.api.errors import GatewayError
from gateway.fleet.backend import Backend

if TYPE_CHECKING:
    from gateway.app import Gateway


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    if gw.admin_key is not None:
        auth = request.headers.get("authorization", "")
        token = auth.partition(" ")[2].strip()
        if not hmac.compare_digest(token.encode(), gw.admin_key.encode()):
            raise GatewayError(
                401, "Admin API: missing or wrong admin key.", code="invalid_api_key"
            )
    return gw


def backend_summary(gw: Gateway, b: Backend) -> dict[str, Any]:
    """One backend as JSON: state, load (last scrape), in-flight, errors. Ages in seconds."""
    now = gw.controller.clock()
    load = None
    if b.load is not None:
        load = {
            "waiting": b.load.waiting,
            "running": b.load.running,
            "kv_cache_usage": b.load.kv_cache_usage,
            "age_s": round(now - b.load.scraped_at, 3),
        }
    return {
        "id": b.id,
        "url": b.base_url,
        "role": b.config.role.value,
        "state": b.state.value,
        "models": list(b.models),
        "in_flight": b.in_flight,
        "requests_served": b.requests_served,
        "load": load,
        "last_scrape_age_s": (
            None if b.last_scrape_ok_at is None else round(now - b.last_scrape_ok_at, 3)
        ),
        "last_error": b.last_error,
        "last_error_at": b.last_error_at,
        "config_error": b.config_error,
        "consecutive_probe_failures": b.consecutive_probe_failures,
        "consecutive_traffic_failures": b.consecutive_traffic_failures,
    }


async def list_backends(request: Request) -> Response:
    """Every backend, in config order."""
    gw = _gateway(request)
    return JSONResponse({"backends": [backend_summary(gw, b) for b in gw.fleet.backends]})


async def get_backend(backend_id: str, request: Request) -> Response:
    """One backend with its recent state history (last 20 transitions)."""
    gw = _gateway(request)
    b = gw.fleet.get(backend_id)
    if b is None:
        raise GatewayError(404, f"No backend with id '{backend_id}'.", code="backend_not_found")
    out = backend_summary(gw, b)
    out["history"] = [
        {"at": t.at, "from": t.from_state.value, "to": t.to_state.value, "reason": t.reason}
        for t in b.history
    ]
    return JSONResponse(out)


def install_routes(app: FastAPI) -> None:
    """Register the ``/admin/...`` routes on ``app``."""
    app.add_api_route("/admin/backends", list_backends, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/admin/backends/{backend_id}", get_backend, methods=["GET"], include_in_schema=False
    )
