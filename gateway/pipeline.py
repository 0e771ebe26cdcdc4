"""The request pipeline: pick a backend, forward, fail over, record the outcome.

``api/openai.py`` parses just enough of a request to build a :class:`RequestContext`;
:meth:`Pipeline.open` then runs the attempts: the router picks the least-loaded routable
backend serving the model (never one this request already tried), the upstream pool
sends the raw body, and the answer is accepted once its start is known to be good
(non-streams: the whole body; streams: the first complete events). Until then nothing has
reached the client, so a connect error, a broken connection or a 5xx is retried on
another backend (:mod:`gateway.traffic.retry`). Every attempt's outcome feeds the
passive health check and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from starlette.responses import Response

from gateway.api.errors import SERVER_ERROR, GatewayError, error_response
from gateway.config import GatewayConfig
from gateway.fleet.backend import Backend, BackendState, Fleet
from gateway.fleet.controller import FleetController
from gateway.metrics import GatewayMetrics
from gateway.proxy.relay import ClientWatch, Cut, CutHandle, RelayResponse, StreamOutcome
from gateway.proxy.sse import EventFramer, extract_usage
from gateway.proxy.upstream import (
    UpstreamFailure,
    UpstreamPool,
    UpstreamRequest,
    response_headers,
)
from gateway.routing.policy import Router
from gateway.traffic.retry import should_retry

log = logging.getLogger("gateway.pipeline")

_EVENT_STREAM = "text/event-stream"


@dataclass(slots=True)
class RequestContext:
    """One client request as the pipeline sees it (the body is never re-serialised)."""

    endpoint: str
    model: str
    stream: bool
    upstream: UpstreamRequest
    request_id: str
    cut: CutHandle
    session_key: str | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class Opened:
    """A backend's accepted answer start: the response, and what was read of it."""

    backend: Backend
    resp: aiohttp.ClientResponse
    data: bytes
    framer: EventFramer | None


class Pipeline:
    """Runs requests against the fleet; one per app, built in the lifespan."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        router: Router,
        pool: UpstreamPool,
        controller: FleetController,
        metrics: GatewayMetrics,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.router = router
        self.pool = pool
        self.controller = controller
        self.metrics = metrics
        self._attempt_children: dict[tuple[str, str], object] = {}
        self.router_clock = controller.clock

    # ---- candidates -------------------------------------------------------------------
    def candidates(self, model: str, tried: list[str]) -> list[Backend]:
        """Routable backends serving ``model`` that this request has not tried yet."""
        return [
            b
            for b in self.fleet.backends
            if b.state is BackendState.WARM and model in b.models and b.id not in tried
        ]

    def retry_after_s(self) -> float:
        """When a backend could plausibly be routable again: one recovery of probes."""
        h = self.cfg.health
        return max(1.0, h.interval_s * h.recover_threshold)

    # ---- attempts -----------------------------------------------------------------------
    def _count_attempt(self, backend: Backend, outcome: str) -> None:
        key = (backend.id, outcome)
        child = self._attempt_children.get(key)
        if child is None:
            child = self._attempt_children[key] = self.metrics.upstream_attempts.labels(*key)
        child.inc()  # type: ignore[attr-defined]

    async def open(self, ctx: RequestContext) -> Opened | Response:
        """Find a backend whose answer starts well; the caller then sends it to the client.

        Returns :class:`Opened` (the caller owns ``resp`` and the backend's in-flight
        slot), or a final :class:`Response` when every attempt failed (a backend's own
        5xx answer is passed on unchanged). Raises :class:`GatewayError` (503) when no
        backend can serve the model. Cancellation (client gone) propagates after
        releasing everything.
        """
        tried: list[str] = []
        failure: UpstreamFailure | None = None
        max_attempts = self.cfg.proxy.max_attempts
        attempt = 0
        while attempt < max_attempts:
            backend = self.router.pick(self.candidates(ctx.model, tried), ctx.session_key)
            if backend is None:
                break
            attempt += 1
            tried.append(backend.id)
            if failure is not None:
                self.metrics.retries.labels(failure.kind).inc()
            backend.in_flight += 1
            backend.active.add(ctx.cut)
            try:
                return await self._attempt(backend, ctx)
            except UpstreamFailure as f:
                self._release(backend, ctx)
                failure = f
                self._record_failure(f, ctx)
                if not should_retry(f.kind, attempt, max_attempts):
                    break
            except asyncio.CancelledError:
                self._release(backend, ctx)
                if ctx.cut.reason != Cut.DRAIN_DEADLINE:
                    raise
                # The backend's drain deadline ended this attempt before any byte reached
                # the client: not the backend's fault, and safe to send elsewhere.
                ctx.cut.absorb()
                ctx.cut.rearm()
                failure = UpstreamFailure(backend, "drained", "backend drained before answering")
                self._count_attempt(backend, "drained")
            except BaseException:
                self._release(backend, ctx)
                raise
        return self._give_up(ctx, failure)

    @staticmethod
    def _release(backend: Backend, ctx: RequestContext) -> None:
        """Give back the backend slot this request held."""
        backend.in_flight -= 1
        backend.active.discard(ctx.cut)

    def _served(self, backend: Backend) -> None:
        """Count one request served by ``backend`` (10,000-request cycle trigger, warm-pool
        hit ratio: served by a backend that was warm and past its slow start)."""
        backend.requests_served += 1
        m = self.metrics
        m.warm_pool_requests += 1
        if self.router.weight(backend, self.router_clock()) >= 1.0:
            m.warm_pool_hits += 1

    async def _attempt(self, backend: Backend, ctx: RequestContext) -> Opened:
        """One attempt on ``backend``: send, then read what must be read before the client
        may see anything (a non-stream's whole body, a stream's first complete events).

        One timer covers the attempt: ``ttfb_timeout_s`` until the response (for streams:
        its first event) arrives, then ``idle_timeout_s`` re-armed at every chunk of a
        body. Raises :class:`UpstreamFailure`; the response is closed on any failure.
        """
        proxy = self.cfg.proxy
        resp: aiohttp.ClientResponse | None = None
        waiting_first_byte = True
        try:
            async with asyncio.timeout(proxy.ttfb_timeout_s) as timer:
                resp = await self.pool.send(
                    backend, ctx.upstream, self.controller.api_keys[backend.id]
                )
                status = resp.status
                if ctx.stream and status == 200 and resp.content_type == _EVENT_STREAM:
                    framer = EventFramer()
                    first = await self._first_events(backend, resp, framer)
                    return Opened(backend, resp, first, framer)
                waiting_first_byte = False
                body = await self._read_body(resp, timer, proxy.idle_timeout_s)
                if status >= 500 or status in (401, 403):
                    raise UpstreamFailure(
                        backend,
                        "status" if status >= 500 else "auth",
                        f"backend answered {status}",
                        status,
                        body,
                        response_headers(resp),
                    )
                return Opened(backend, resp, body, None)
        except TimeoutError:
            if resp is not None:
                resp.close()
            if waiting_first_byte:
                raise UpstreamFailure(
                    backend,
                    "ttfb_timeout",
                    f"no answer within {proxy.ttfb_timeout_s:g} s (ttfb_timeout_s)",
                ) from None
            raise UpstreamFailure(
                backend,
                "idle_timeout",
                f"response body stalled for {proxy.idle_timeout_s:g} s (idle_timeout_s)",
            ) from None
        except (aiohttp.ClientError, ConnectionError) as e:
            if resp is not None:
                resp.close()
            raise UpstreamFailure(
                backend, "disconnected", f"connection broke in the response: {e!r}"
            ) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    @staticmethod
    async def _read_body(
        resp: aiohttp.ClientResponse, timer: asyncio.Timeout, idle_s: float
    ) -> bytes:
        """The whole body; ``idle_s`` bounds each silence (re-arms ``timer``), not the total."""
        loop = asyncio.get_running_loop()
        timer.reschedule(loop.time() + idle_s)
        content = resp.content
        parts: list[bytes] = []
        while chunk := await content.readany():
            parts.append(chunk)
            timer.reschedule(loop.time() + idle_s)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @staticmethod
    async def _first_events(
        backend: Backend, resp: aiohttp.ClientResponse, framer: EventFramer
    ) -> bytes:
        """Read until at least one complete event is in (under the caller's TTFB timer)."""
        content = resp.content
        while True:
            chunk = await content.readany()
            if not chunk:
                raise UpstreamFailure(
                    backend, "disconnected", "stream ended before its first event"
                )
            out = framer.feed(chunk)
            if out:
                return out

    def _record_failure(self, f: UpstreamFailure, ctx: RequestContext) -> None:
        backend = f.backend
        self._count_attempt(backend, f.kind)
        backend.note_error(f"{ctx.endpoint}: {f.message}")
        if f.kind == "auth":
            self.controller._config_error(backend, f.message, f.status)
            return
        self.controller.on_traffic(backend, failed=True)
        log.info(
            "attempt on %s failed (%s): %s [request %s]",
            backend.id,
            f.kind,
            f.message,
            ctx.request_id,
        )

    def _give_up(self, ctx: RequestContext, f: UpstreamFailure | None) -> Response:
        rid = ctx.request_id
        idh = self.cfg.server.request_id_header
        if f is None:
            raise GatewayError(
                503,
                f"No backend is available for model '{ctx.model}' right now "
                "(all are unhealthy, draining or cooling down).",
                SERVER_ERROR,
                "no_backend_available",
                retry_after_s=self.retry_after_s(),
            )
        if f.kind == "status" and f.status is not None:
            headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in f.headers)
            headers[idh] = rid
            return Response(f.body, status_code=f.status, headers=headers)
        if f.kind == "auth":
            return error_response(
                502,
                f"Backend '{f.backend.id}' rejected the gateway's credentials "
                f"({f.status}): the gateway's backend key is misconfigured.",
                SERVER_ERROR,
                "backend_auth_failed",
                request_id=rid,
                id_header=idh,
            )
        if f.kind == "drained":
            return error_response(
                503,
                f"The backend serving model '{ctx.model}' was drained and no other could "
                "take the request.",
                SERVER_ERROR,
                "no_backend_available",
                retry_after_s=self.retry_after_s(),
                request_id=rid,
                id_header=idh,
            )
        if f.kind in ("ttfb_timeout", "idle_timeout"):
            return error_response(
                504,
                f"The backend did not answer in time: {f.message}",
                SERVER_ERROR,
                "upstream_timeout",
                request_id=rid,
                id_header=idh,
            )
        return error_response(
            502,
            f"Could not get an answer from a backend for model '{ctx.model}': {f.message}",
            SERVER_ERROR,
            "upstream_unavailable",
            request_id=rid,
            id_header=idh,
        )

    # ---- completion -----------------------------------------------------------------------
    def finish_body(self, ctx: RequestContext, opened: Opened) -> Response:
        """The non-streaming answer for the client; releases the backend slot."""
        backend, resp, body = opened.backend, opened.resp, opened.data
        self._release(backend, ctx)
        self._served(backend)
        status = resp.status
        self._count_attempt(backend, "ok" if status < 400 else f"http_{status}")
        self.controller.on_traffic(backend, failed=False)
        headers = response_headers(resp)
        resp.release()
        if status == 200 and resp.headers.get("content-encoding") is None:
            self._count_usage(ctx.model, extract_usage(body))
        headers.append((self.cfg.server.request_id_header.encode(), ctx.request_id.encode()))
        r = Response(body, status_code=status)
        r.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
        return r

    def relay(self, ctx: RequestContext, opened: Opened, watch: ClientWatch) -> RelayResponse:
        """The streaming answer for the client; the slot is released when the stream ends."""
        backend, resp = opened.backend, opened.resp
        headers = response_headers(opened.resp)
        headers.append((self.cfg.server.request_id_header.encode(), ctx.request_id.encode()))
        assert opened.framer is not None

        def on_done(outcome: str, framer: EventFramer, first_sent_at: float | None) -> None:
            self._release(backend, ctx)
            self._served(backend)
            m = self.metrics
            if first_sent_at is not None:
                m.ttft.labels(ctx.endpoint).observe(first_sent_at - ctx.started)
            m.observe_duration(ctx.endpoint, time.perf_counter() - ctx.started)
            if outcome == StreamOutcome.CLIENT_GONE:
                m.client_disconnects.labels(ctx.endpoint).inc()
                m.count_request(ctx.endpoint, ctx.model, 499)
                self._count_attempt(backend, "client_gone")
                return
            m.count_request(ctx.endpoint, ctx.model, 200)
            self._count_usage(ctx.model, framer.usage())
            if outcome == StreamOutcome.OK:
                self._count_attempt(backend, "ok")
                self.controller.on_traffic(backend, failed=False)
            elif outcome in (Cut.DRAIN_DEADLINE, Cut.SHUTDOWN):
                self._count_attempt(backend, outcome)  # ended by us, not the backend's fault
                m.stream_errors.labels(backend.id, outcome).inc()
            else:
                self._count_attempt(backend, outcome)
                m.stream_errors.labels(backend.id, outcome).inc()
                backend.note_error(f"{ctx.endpoint}: stream ended with {outcome}")
                self.controller.on_traffic(backend, failed=True)

        return RelayResponse(
            resp,
            headers,
            opened.data,
            opened.framer,
            watch,
            ctx.cut,
            self.cfg.proxy.idle_timeout_s,
            on_done,
        )

    def _count_usage(self, model: str, usage: tuple[int, int] | None) -> None:
        if usage is None:
            return
        prompt, completion = usage
        self.metrics.tokens.labels(model, "prompt").inc(prompt)
        self.metrics.tokens.labels(model, "completion").inc(completion)
