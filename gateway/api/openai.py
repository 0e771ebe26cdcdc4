"""The OpenAI-compatible surface: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/models`` and pass-through of vLLM routes that carry a ``model``.

The raw JSON body is read once and forwarded byte for byte: only ``model`` and ``stream``
(and the presence of the endpoint's required field) are looked at, so unknown fields such
as ``top_k``, ``guided_json``, ``tools`` or ``stream_options`` survive. Errors are
OpenAI-shaped with the status OpenAI would use (see :mod:`gateway.api.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.api.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    GatewayError,
    error_response,
    shutting_down_response,
)
from gateway.api.merging import EMBEDDINGS, engine_requests, merge_key, part_of, route_key
from gateway.config import ClientKey
from gateway.core.vocab import Cut
from gateway.gate import Rejected, cap_max_tokens, ratelimit_headers
from gateway.pipeline import Opened, RequestContext
from gateway.proxy.relay import ClientWatch, CutHandle
from gateway.proxy.upstream import UpstreamRequest, forward_headers
from gateway.traffic.admission import completion_budget, estimate_tokens

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.api")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

# Field each endpoint cannot do without (vLLM answers 400 without it too).
REQUIRED_FIELD = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
}


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def new_request_id() -> str:
    """A fresh request id: 32 hex digits (128 random bits, like a UUID4's hex)."""
    return secrets.token_hex(16)


def sane_request_id(value: bytes | None) -> str:
    """The client's request id if sane (1-200 printable ASCII characters, what RFC 9110
    field values should be, so it reads the same in every header, log and codec), else a
    new one."""
    if value:
        rid = value.decode("latin-1")
        if len(rid) <= 200 and rid.isascii() and rid.isprintable():
            return rid
    return new_request_id()


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


async def read_body(
    receive: Receive, declared: bytes | None, limit: int, idle_timeout_s: float = 30.0
) -> bytes:
    """The whole request body from ASGI ``receive``, refusing more than ``limit`` bytes
    with a 413 (checked against ``content-length`` first, then while reading), and a
    client that stops sending it for ``idle_timeout_s`` seconds with a 408 (a slow upload
    may take as long as it likes, as long as bytes keep coming)."""
    too_big = GatewayError(
        413,
        f"Request body is larger than the gateway's limit of {limit} bytes "
        "(server.max_body_bytes).",
        INVALID_REQUEST,
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    parts: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_timeout_s) as timer:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    parts.append(chunk)
                if not message.get("more_body", False):
                    break
                timer.reschedule(loop.time() + idle_timeout_s)
    except TimeoutError:
        raise GatewayError(
            408,
            f"The request body stalled: no bytes for {idle_timeout_s:g} s "
            "(server.body_idle_timeout_s).",
            INVALID_REQUEST,
            "request_timeout",
        ) from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _UploadCut(Exception):
    """The shutdown's grace period ended while the request's body was still arriving."""


async def _read_body(gw: Gateway, receive: Receive, declared: bytes | None) -> bytes:
    """:func:`read_body` with the request counted in ``gw.uploading``: a shutdown waits
    for it during its grace period, then cancels it (:class:`_UploadCut`, answered 503
    ``gateway_shutting_down`` without the rest of the body, rather than uvicorn's bare 500
    when its own shutdown timeout cancels the request)."""
    task = asyncio.current_task()
    assert task is not None
    gw.uploading.add(task)
    try:
        return await read_body(
            receive, declared, gw.cfg.server.max_body_bytes, gw.cfg.server.body_idle_timeout_s
        )
    except asyncio.CancelledError:
        if gw.uploads_cut and task.uncancel() == 0:
            raise _UploadCut from None
        raise
    finally:
        gw.uploading.discard(task)


def check_content_encoding(value: bytes | None) -> None:
    """415 for a compressed request body (``Content-Encoding`` other than ``identity``):
    the gateway reads the JSON to route it, and vLLM does not accept compressed bodies
    either (RFC 9110 section 15.5.16)."""
    if value is None:
        return
    coding = value.decode("latin-1").strip().lower()
    if coding in ("", "identity"):
        return
    raise GatewayError(
        415,
        f"Request bodies with Content-Encoding '{coding}' are not supported; send "
        "uncompressed JSON.",
        code="unsupported_content_encoding",
    )


def parse_payload(body: bytes, endpoint: str) -> dict[str, Any]:
    """The JSON object of a request; raises 400 for bad JSON or a missing field."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise GatewayError(
            400, f"Request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    except RecursionError:
        raise GatewayError(
            400, "Request body JSON is nested too deeply.", code="invalid_json"
        ) from None
    if not isinstance(payload, dict):
        raise GatewayError(400, "Request body must be a JSON object.", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400,
            "'model' is required and must be a string.",
            code="missing_required_parameter",
            param="model",
        )
    required = REQUIRED_FIELD.get(endpoint)
    if required is not None and required not in payload:
        raise GatewayError(
            400,
            f"'{required}' is a required property.",
            code="missing_required_parameter",
            param=required,
        )
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise GatewayError(400, "'stream' must be a boolean.", code="invalid_type", param="stream")
    return payload


async def check_model(gw: Gateway, model: str) -> None:
    """404 ``model_not_found`` when no backend lists ``model`` (after one fresh look);
    503 only while no backend has ever listed its models (nothing is reachable yet)."""
    if any(model in b.models for b in gw.fleet.backends):
        return
    await gw.controller.refresh_models_soon()
    if any(model in b.models for b in gw.fleet.backends):
        return
    misconfigured = [b.id for b in gw.fleet.backends if b.config_error and not b.models]
    if misconfigured:
        raise GatewayError(
            502,
            f"Backends {', '.join(misconfigured)} reject the gateway's credentials, so the "
            f"model '{model}' cannot be looked up: the gateway's backend key is misconfigured "
            "(backends[].api_key / api_key_env).",
            SERVER_ERROR,
            "backend_auth_failed",
        )
    # 404 as soon as some backend told us what it serves: a typo must not get a 503 that
    # SDKs retry (case BUG-07); 503 only while no backend has answered at all.
    if any(b.model_cards or b.config.models is not None for b in gw.fleet.backends):
        raise GatewayError(
            404,
            f"The model '{model}' does not exist or is not served by any backend.",
            INVALID_REQUEST,
            "model_not_found",
            param="model",
        )
    raise GatewayError(
        503,
        f"No reachable backend serves the model '{model}' right now.",
        SERVER_ERROR,
        "no_backend_available",
        retry_after_s=gw.pipeline.retry_after_s(),
    )


def check_client_key(gw: Gateway, authorization: bytes | None) -> ClientKey | None:
    """The client's configured key; 401 unless it presents one (no keys configured: open,
    None)."""
    if not gw.client_keys:
        return None
    auth = authorization.decode("latin-1") if authorization else ""
    scheme, _, token = auth.partition(" ")
    key = gw.client_keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if key is None:
        raise GatewayError(
            401,
            "Incorrect API key provided."
            if auth
            else "Missing API key: send 'Authorization: Bearer <key>'.",
            INVALID_REQUEST,
            "invalid_api_key",
        )
    return key


def log_refusal(e: GatewayError, endpoint: str, request_id: str) -> None:
    """Log an error the gateway answered itself, with the request id (client mistakes at
    INFO, a too-large body, auth and capacity problems at WARNING)."""
    level = logging.INFO if e.status in (400, 404, 405) else logging.WARNING
    log.log(
        level,
        "%s %s: %d %s: %s [request %s]",
        "POST",
        endpoint,
        e.status,
        e.code,
        e.message,
        request_id,
    )


def answered(
    metrics: GatewayMetrics, endpoint: str, model: str, status: int, started: float
) -> None:
    """Record one client request answered without a stream: its ``status`` in
    ``gateway_requests_total`` and its latency since ``started`` (``time.perf_counter()``
    seconds at arrival) in both latency histograms, the answer being ready now (its first
    byte and its end go out together). A 499 (the client hung up: no byte reached it) has a
    duration but no time to first byte. ``model`` is "" when not known yet."""
    metrics.count_request(endpoint, model, status)
    elapsed = time.perf_counter() - started
    metrics.observe_latency(endpoint, model, None if status == 499 else elapsed, elapsed)


async def model_response(gw: Gateway, scope: Scope, receive: Receive) -> Response:
    """Forward one model request (stream or not) through the pipeline; the answer to send.

    Works on the raw ASGI ``scope``/``receive`` (no framework request object), because it is
    the data path: see :class:`gateway.app.GatewayApp`.
    """
    cfg = gw.cfg
    metrics = gw.metrics
    endpoint: str = scope["path"]
    idh = cfg.server.request_id_header
    started = time.perf_counter()
    # one pass over the headers for what the gateway reads
    id_key, session_key_name, priority_key = gw.header_keys
    authorization = declared = rid_value = session = prio_value = encoding = None
    for k, v in scope["headers"]:
        if k == b"authorization":
            authorization = v
        elif k == b"content-length":
            declared = v
        elif k == b"content-encoding":
            encoding = v
        elif k == id_key:
            rid_value = v
        elif k == session_key_name:
            session = v
        elif k == priority_key:
            prio_value = v
    rid = sane_request_id(rid_value)
    if gw.shutting_down:
        answered(metrics, endpoint, "", 503, started)
        return shutting_down_response(rid, idh)
    try:
        key = check_client_key(gw, authorization)
        check_content_encoding(encoding)
        body = await _read_body(gw, receive, declared)
        payload = parse_payload(body, endpoint)
        model: str = payload["model"]
        await check_model(gw, model)
    except GatewayError as e:
        answered(metrics, endpoint, "", e.status, started)
        log_refusal(e, endpoint, rid)
        return e.response(rid, idh)
    except ClientGone:
        metrics.client_disconnects.labels(endpoint).inc()
        answered(metrics, endpoint, "", 499, started)
        return Response(status_code=499)
    except _UploadCut:
        answered(metrics, endpoint, "", 503, started)
        return shutting_down_response(rid, idh)
    stream = payload.get("stream") is True
    cut = CutHandle()
    watch = ClientWatch(receive, cut)
    # admission: entry (key limits), resource (saturation), scheduler (slot or queue)
    gate = gw.gate
    ticket = verdict = None
    prio = gate.priority(prio_value, key)
    if gw.forecasts is not None:
        gw.forecasts.arrive(model, prio)
    seqs = engine_requests(endpoint, payload)  # prompts x n (embeddings: inputs)
    if gate.enabled:
        est = estimate_tokens(
            len(body),
            completion_budget(payload),
            cfg.admission.default_max_tokens,
            0 if endpoint == EMBEDDINGS else seqs,
        )
        client = key.name if key is not None else (scope.get("client") or ("anonymous",))[0]
        try:
            ticket, verdict = await gate.admit(model, client, key, prio, est, len(body) // 4, rid)
        except Rejected as r:
            watch.stop()
            answered(metrics, endpoint, model, r.response.status_code, started)
            return r.response
        except asyncio.CancelledError:
            watch.stop()
            if cut.reason is None:
                raise
            cut.absorb()
            metrics.client_disconnects.labels(endpoint).inc()
            answered(metrics, endpoint, model, 499, started)
            return Response(status_code=499)
        cap = gate.max_tokens_cap()
        if cap is not None:
            body = cap_max_tokens(payload, cap) or body
    query = scope.get("query_string", b"")
    path = endpoint + ("?" + query.decode("latin-1") if query else "")
    ctx = RequestContext(
        endpoint=endpoint,
        model=model,
        stream=stream,
        upstream=UpstreamRequest(
            scope["method"],
            path,
            forward_headers(scope["headers"], idh, rid, stream),
            body,
            stream,
        ),
        request_id=rid,
        cut=cut,
        session_key=session.decode("latin-1") if session is not None else None,
        started=started,
        ticket=ticket,
        extra_headers=[(k.encode(), v.encode()) for k, v in ratelimit_headers(verdict).items()]
        if verdict is not None
        else [],
        priority=prio,
    )
    if seqs > 1:
        if endpoint == EMBEDDINGS:
            ctx.pooled_extra = seqs - 1
        else:
            ctx.places = seqs
    if gw.batching is not None and gw.batching.merge and not stream:
        up = ctx.upstream
        mkey = merge_key(endpoint, payload, route_key(up.path, up.headers, idh))
        if mkey is not None:
            ctx.merge_key, ctx.merge_part = mkey, part_of(endpoint, payload)
    try:
        opened = await gw.pipeline.open(ctx)
    except GatewayError as e:
        watch.stop()
        gate.release(ticket)
        answered(metrics, endpoint, model, e.status, started)
        log_refusal(e, endpoint, rid)
        return e.response(rid, idh)
    except asyncio.CancelledError:
        watch.stop()
        gate.release(ticket)
        if ctx.cut.reason is None:
            raise
        if ctx.cut.absorb() == Cut.CLIENT_GONE:
            metrics.client_disconnects.labels(endpoint).inc()
            answered(metrics, endpoint, model, 499, started)
            return Response(status_code=499)
        answered(metrics, endpoint, model, 503, started)
        return shutting_down_response(rid, idh)
    if not isinstance(opened, Opened):  # a merged request's share, or a final refusal
        watch.stop()
        gate.release(ticket)
        answered(metrics, endpoint, model, opened.status_code, started)
        return opened
    if opened.framer is not None:  # the stream's end observes it (Pipeline.relay)
        return gw.pipeline.relay(ctx, opened, watch)
    watch.stop()
    response = gw.pipeline.finish_body(ctx, opened)
    gate.release(ticket)
    answered(metrics, endpoint, model, response.status_code, started)
    return response


async def proxy(request: Request) -> Response:
    """The framework route for model requests (the same code as the ASGI fast path)."""
    return await model_response(_gateway(request), request.scope, request.receive)


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: every backend in service asked now (model discovery,
    :meth:`gateway.fleet.discovery.ModelDiscovery.list_live`), each id once, vLLM fields
    kept.

    Order is deterministic: backends in config order, each backend's own order. A backend
    that fails to answer is skipped; with none answering: 503 + ``retry-after``.
    """
    gw = _gateway(request)
    idh = gw.cfg.server.request_id_header
    rid = sane_request_id(request.headers.get(idh, "").encode("latin-1"))
    try:
        check_client_key(gw, request.headers.get("authorization", "").encode("latin-1"))
    except GatewayError as e:
        return e.response(rid, idh)
    answered = await gw.controller.discovery.list_live()
    if not answered:
        return error_response(
            503,
            "No backend is reachable to list models.",
            SERVER_ERROR,
            "no_backend_available",
            retry_after_s=gw.pipeline.retry_after_s(),
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


def install_routes(app_router: FastAPI, passthrough: list[str]) -> None:
    """Register the OpenAI routes and the vLLM pass-through routes on ``app``.

    Routes go straight on the app (no included routers): one less dispatch layer per
    request on the hot path."""
    for path in (*MODEL_ROUTES, *passthrough):
        app_router.add_api_route(path, proxy, methods=["POST"], include_in_schema=False)
    app_router.add_api_route("/v1/models", list_models, methods=["GET"], include_in_schema=False)
    app_router.add_api_route(
        "/v1/models/{model:path}", get_model, methods=["GET"], include_in_schema=False
    )
