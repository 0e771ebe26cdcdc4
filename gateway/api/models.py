"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models the fleet serves, asked of every
backend in service now, each id once, vLLM's own fields kept."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.api.errors import INVALID_REQUEST, SERVER_ERROR, Refusal, error_response, render
from gateway.api.parsing import check_client_key, sane_request_id
from gateway.flow.candidates import recovery_s

if TYPE_CHECKING:
    from gateway.wiring import Gateway


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway  # starlette's State holds untyped attributes
    return gw


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: every backend in service asked now (model discovery,
    :meth:`gateway.fleet.model_discovery.ModelDiscovery.list_live`), each id once, vLLM fields
    kept.

    Order is deterministic: backends in config order, each backend's own order. A backend
    that fails to answer is skipped; with none answering: 503 + ``retry-after``.
    """
    gw = _gateway(request)
    idh = gw.cfg.server.request_id_header
    rid = sane_request_id(request.headers.get(idh, "").encode("latin-1"))
    try:
        check_client_key(gw, request.headers.get("authorization", "").encode("latin-1"))
    except Refusal as e:
        return render(e, rid, idh)
    answered = await gw.controller.discovery.list_live()
    if not answered:
        return error_response(
            503,
            "No backend is reachable to list models.",
            SERVER_ERROR,
            "no_backend_available",
            retry_after_s=recovery_s(gw.cfg.health),
            request_id=rid,
            id_header=idh,
        )
    seen: dict[str, dict[str, Any]] = {}
    for b, cards in answered:
        for card in cards:
            if b.config.models is not None and card.id not in b.config.models:
                continue
            seen.setdefault(card.id, card.raw)
    body = json.dumps({"object": "list", "data": list(seen.values())}).encode()
    return Response(body, media_type="application/json", headers={idh: rid})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the aggregated card, or 404 ``model_not_found``."""
    listing = await list_models(request)
    if listing.status_code != 200:
        return listing
    model_id = request.path_params["model"]
    for card in json.loads(bytes(listing.body))["data"]:
        if card.get("id") == model_id:
            return Response(json.dumps(card).encode(), media_type="application/json")
    return error_response(
        404,
        f"The model '{model_id}' does not exist.",
        INVALID_REQUEST,
        "model_not_found",
        param="model",
    )


def install_routes(app_router: FastAPI) -> None:
    """Register ``GET /v1/models`` and ``GET /v1/models/{model}`` on ``app_router``."""
    app_router.add_api_route("/v1/models", list_models, methods=["GET"], include_in_schema=False)
    app_router.add_api_route(
        "/v1/models/{model:path}", get_model, methods=["GET"], include_in_schema=False
    )
