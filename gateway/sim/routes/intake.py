"""What every inference route of the simulated server does first: record the request for
``/sim/stats`` and apply the injected faults (:mod:`gateway.sim.faults`) -- latency, hangs,
error statuses, dropped connections -- plus the errors of a sleeping engine."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from fastapi import Request
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim.asgi import DroppedConnection, close_connection, error_response, wait_disconnect
from gateway.sim.faults import FaultDecision
from gateway.sim.state import SimState


def fault_error(d: FaultDecision) -> P.SimHTTPError:
    """The error response of an injected failure: 429 with ``Retry-After`` (whole seconds)
    and ``retry-after-ms`` for ``rate_limit``, else ``d.status`` (500, 503, ...)."""
    if d.kind == "rate_limit":
        headers = {
            "Retry-After": str(math.ceil(d.retry_after_s)),
            "retry-after-ms": str(round(d.retry_after_s * 1000)),
        }
        return P.error(
            429,
            "Too many requests (injected by the simulator). Please retry later.",
            "Too Many Requests",
            None,
            headers,
        )
    err_type = {500: "InternalServerError", 503: "Service Unavailable"}.get(d.status)
    return P.error(d.status, f"Injected failure (simulator, status {d.status}).", err_type)


def sleeping_error() -> P.SimHTTPError:
    """503 for inference while the engine sleeps (vLLM 0.32 would hold the request)."""
    return P.error(503, "The engine is sleeping. Call /wake_up first.", "Service Unavailable")


def record(state: SimState, request: Request, body: Any) -> None:
    """Keep ``request`` (path, query, method, headers, parsed JSON ``body`` or None, and
    ``at``: its arrival, unix seconds of the simulator's clock) among the recent requests
    ``/sim/stats`` shows."""
    state.recent.append(
        {
            "at": time.time(),
            "path": request.url.path,
            "query": request.url.query,
            "method": request.method,
            "headers": dict(request.headers),
            "body": body,
        }
    )


async def apply_faults(
    state: SimState, request: Request, stream: bool
) -> tuple[FaultDecision, Response | None]:
    """Draw this request's fault decision and act on what happens before any answer: sleep
    its added latency; hang until the client leaves or the server closes (then 499); an
    injected error status; a dropped connection for a non-streamed request (a stream drops
    later, after ``drop_after`` chunks or ``drop_after_tokens`` tokens). Returns the
    decision and the response to send instead of serving (None: serve it). Raises
    :class:`DroppedConnection` when the connection cannot be closed from here."""
    d = state.faults.decide()
    if d.latency_s > 0:
        await asyncio.sleep(d.latency_s)
    if d.hang:
        wait_closing = asyncio.ensure_future(state.closing.wait())
        wait_client = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({wait_closing, wait_client}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wait_closing.cancel()
            wait_client.cancel()
        if not wait_client.done() or wait_client.cancelled():
            # Server shutting down: the hung request dies with its connection.
            await close_connection(request)
        return d, Response(status_code=499)
    if d.kind != "ok":
        return d, error_response(fault_error(d))
    if d.drops and not stream:
        state.dropped_connections += 1
        if not await close_connection(request):
            raise DroppedConnection("simulated dropped connection")
        return d, Response(status_code=499)
    return d, None
