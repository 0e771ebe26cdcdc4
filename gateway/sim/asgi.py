"""ASGI plumbing of the simulator: vLLM's auth and request-id middleware, SSE response,
JSON helpers, and access to the connection's transport for the drop fault."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import uuid
from typing import Any

import anyio
from fastapi import FastAPI, Request
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.sim import protocol as P
from gateway.sim.state import SimState

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # vLLM AuthenticationMiddleware
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
TRANSPORT_KEY = "gateway.sim.transport"


class SimFastAPI(FastAPI):
    """FastAPI that remembers the connection's transport (for the drop fault)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle
            scope[TRANSPORT_KEY] = getattr(cycle, "transport", None)
        await super().__call__(scope, receive, send)


class SimEventSourceResponse(EventSourceResponse):
    """SSE response with vLLM's headers, independent of sse-starlette's global exit flag.

    sse-starlette ends every stream in the process when any uvicorn server there
    shuts down (``AppStatus``); simulators come and go inside test processes, so
    their streams end only through their own engine (``EngineRunner.stop``).
    The ``Cache-Control``, ``Connection`` and ``X-Accel-Buffering`` headers that
    sse-starlette adds are removed: vLLM's ``StreamingResponse`` sends none of them.
    """

    _DROP_HEADERS = frozenset({b"cache-control", b"connection", b"x-accel-buffering"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k not in self._DROP_HEADERS]

    @staticmethod
    async def _listen_for_exit_signal() -> None:
        await anyio.sleep_forever()


class SimMiddleware:
    """Pure ASGI: counts requests, checks the API key like vLLM, echoes X-Request-Id."""

    def __init__(self, app: ASGIApp, state: SimState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st = self.state
        path: str = scope["path"]
        st.requests_by_path[path] += 1
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
                st.responses_by_status[str(message["status"])] += 1
            await send(message)

        key = st.config.api_key
        if (
            key
            and scope.get("method") != "OPTIONS"
            and path.startswith(GUARDED_PREFIX)
            and not _token_ok(headers.get("authorization"), key)
        ):
            resp = JSONResponse({"error": "Unauthorized"}, status_code=401)
            await resp(scope, receive, send_wrapper)
            return
        tracked = path in GENERATION_PATHS
        if tracked:
            st.open_by_path[path] += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if tracked:
                st.open_by_path[path] -= 1


def _token_ok(header: str | None, key: str) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        hashlib.sha256(token.encode()).digest(), hashlib.sha256(key.encode()).digest()
    )


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``body`` as compact JSON (vLLM's formatting)."""
    return Response(
        P.dumps(body), status_code=status, headers=headers, media_type="application/json"
    )


def error_response(err: P.SimHTTPError) -> Response:
    """The HTTP answer of a ``SimHTTPError``."""
    return json_response(err.body, err.status, err.headers or None)


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def close_connection(request: Request) -> bool:
    """Close the TCP connection under ``request`` without answering; False if impossible."""
    transport = request.scope.get(TRANSPORT_KEY)
    if transport is None:
        return False
    transport.close()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            await wait_disconnect(request.receive)
    return True


class DroppedConnection(Exception):
    """Raised to make the ASGI server cut a connection when the transport is unknown."""
