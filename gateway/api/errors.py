"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Status codes follow OpenAI's API: 400 bad request, 401 bad key, 404 unknown model or
route, 405 wrong method, 413 body too large, 415 compressed body, 429 rate limited (with
``retry-after``), 502 backend failure, 503 nothing can serve now (with ``retry-after``),
504 backend timeout.
A client mistake is never answered with a 5xx: SDKs retry 5xx, which turns bad input into a
retry storm (case BUG-07, tests/cases/test_request_validation.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.core.outcomes import INVALID_REQUEST, SERVER_ERROR, Refusal, shutting_down
from gateway.traffic.retry_after import clamp_retry_after

__all__ = [
    "INVALID_REQUEST",
    "SERVER_ERROR",
    "Refusal",
    "error_body",
    "error_response",
    "render",
]


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    """The JSON bytes of one OpenAI error object."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


def render(
    refusal: Refusal, request_id: str | None = None, id_header: str = "x-request-id"
) -> Response:
    """The HTTP answer for a :class:`gateway.core.outcomes.Refusal`: its status, the OpenAI
    error body, ``retry-after``/``retry-after-ms`` (:func:`retry_after_headers`),
    ``x-should-retry: false`` when a retry cannot help, its own headers and the request
    id."""
    r = error_response(
        refusal.status,
        refusal.message,
        refusal.type,
        refusal.code,
        refusal.param,
        retry_after_s=refusal.retry_after_s,
        request_id=request_id,
        id_header=id_header,
    )
    if not refusal.retryable:
        r.raw_headers.append((b"x-should-retry", b"false"))
    r.raw_headers.extend(encoded_headers(refusal.headers))
    return r


def encoded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """Header (name, value) pairs as the raw bytes ASGI sends (latin-1, RFC 9110)."""
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``retry-after`` (integer seconds, rounded up) and ``retry-after-ms``, for a wait of
    ``seconds`` bounded to [1, 60] s (openai-python honours 0 < value <= 60; a NaN or
    infinite estimate reads as 60). The only place the header's value is computed."""
    seconds = clamp_retry_after(seconds)
    whole = max(1, math.ceil(seconds - 1e-9))
    return {"retry-after": str(whole), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def error_response(
    status: int,
    message: str,
    type_: str = INVALID_REQUEST,
    code: str | int | None = None,
    param: str | None = None,
    *,
    retry_after_s: float | None = None,
    request_id: str | None = None,
    id_header: str = "x-request-id",
) -> Response:
    """A JSON error response in OpenAI shape."""
    headers: dict[str, str] = {}
    if retry_after_s is not None:
        headers.update(retry_after_headers(retry_after_s))
    if request_id:
        headers[id_header] = request_id
    return Response(
        error_body(message, type_, code, param),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


_STATUS_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def install_error_handlers(app: FastAPI) -> None:
    """Make every framework error OpenAI-shaped; FastAPI's 422 becomes a 400 (as vLLM)."""

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refusal)
        return render(exc, getattr(request.state, "request_id", None))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        if status == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        resp = error_response(
            status,
            message,
            INVALID_REQUEST if status < 500 else SERVER_ERROR,
            _STATUS_CODES.get(status),
        )
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(
            400,
            f"Invalid request: {first.get('msg', 'validation failed')}"
            + (f" ({param})" if param else ""),
            INVALID_REQUEST,
            "invalid_request",
            param,
        )

    async def unexpected(request: Request, exc: Exception) -> Response:
        return error_response(
            500, f"Internal gateway error: {type(exc).__name__}", SERVER_ERROR, "internal_error"
        )

    app.add_exception_handler(Refusal, gateway_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


def shutting_down_response(request_id: str | None, id_header: str = "x-request-id") -> Response:
    """The rendered :func:`gateway.core.outcomes.shutting_down` refusal (503, retry in 1 s)."""
    return render(shutting_down(), request_id, id_header)

