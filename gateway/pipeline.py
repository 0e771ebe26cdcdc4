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
import email.utils
import logging
import math
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.responses import Response

from gateway.api.errors import SERVER_ERROR, error_response
from gateway.config import GatewayConfig
from gateway.core.vocab import BackendState, Cut, FailureKind
from gateway.fleet.backend import Backend, Fleet
from gateway.fleet.controller import FleetController
from gateway.gate import AdmissionGate, Ticket
from gateway.metrics import GatewayMetrics
from gateway.proxy.relay import ClientWatch, CutHandle, RelayResponse, StreamOutcome
from gateway.proxy.sse import DONE_TERMINATED, EventFramer, extract_usage, has_event
from gateway.proxy.upstream import UpstreamFailure, UpstreamPool, UpstreamRequest, response_headers
from gateway.routing.policies import Policy
from gateway.traffic.admission import MAX_RETRY_AFTER_S
from gateway.traffic.breaker import BreakerState, windowed_p99
from gateway.traffic.retry import RetryBudget, RetryPolicy, should_retry

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
    ticket: Ticket | None = None  # the admission slot, released when the request ends
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    priority: int = 1  # admission.Prio value: the batcher's bucket
    merge_key: Hashable | None = None  # set when the batcher may merge this request
    merge_part: Any = None  # api.merging.Part of a mergeable request
    merge_slot: Hashable | None = None  # its place in a merge window, until released
    # In-flight places it takes (sequences decoding: prompts x n; 1 for embeddings), and
    # the extra prefill-only engine requests of an embeddings request (inputs - 1).
    places: int = 1
    pooled_extra: int = 0


@dataclass(slots=True)
class Opened:
    """A backend's accepted answer start: the response, and what was read of it."""

    backend: Backend
    resp: aiohttp.ClientResponse
    data: bytes
    framer: EventFramer | None
    sent_at: float = 0.0  # time.perf_counter() when this attempt was sent upstream


class NoCandidate(Exception):
    """No backend this request has not tried can take it now."""


def parse_retry_after(value: str | None, now_unix: float) -> float | None:
    """Seconds in a ``Retry-After`` header (RFC 9110 section 10.2.3: delay-seconds or an
    HTTP-date), or None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now_unix)


class Pipeline:
    """Runs requests against the fleet; one per app, built in the lifespan."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        router: Policy,
        pool: UpstreamPool,
        controller: FleetController,
        metrics: GatewayMetrics,
        gate: AdmissionGate,
    ) -> None:
        self.cfg = cfg
        self.gate = gate
        self.fleet = fleet
        self.router = router
        self.pool = pool
        self.controller = controller
        self.metrics = metrics
        self._attempt_children: dict[tuple[str, str], object] = {}
        self.router_clock = controller.clock
        self.id_header = cfg.server.request_id_header.lower()
        r = cfg.retry
        self.retry = RetryPolicy(r.backoff_base_s, r.backoff_max_s)
        self.shutting_down = False  # the shutdown's grace period is over: no new attempt
        self.retrying = 0  # requests between two attempts (backoff) or on a retry
        self.budget = RetryBudget(
            r.budget_ratio, r.budget_window_s, r.budget_min_per_s, controller.clock
        )
        # (monotonic time, TTFT seconds) of recent streams: the latency fuse, degraded mode
        self.ttft_window: deque[tuple[float, float]] = deque(maxlen=4096)
        # the predictive batcher's driver (gateway.batching.BatchDispatcher), when enabled
        self.batching: Any = None

    def p99_ttft(self, window_s: float, min_samples: int = 20) -> float | None:
        """P99 TTFT (seconds) of the streams whose first token reached the client within
        the last ``window_s`` seconds; None with fewer than ``min_samples`` samples.
        Non-streaming answers have no first token of their own and are not counted."""
        return windowed_p99(self.ttft_window, self.router_clock() - window_s, min_samples)

    # ---- candidates -------------------------------------------------------------------
    def candidates(self, model: str, tried: list[str], now: float) -> list[Backend]:
        """Backends that may take a request for ``model`` now and that this request has
        not tried: warm, serving it, not cooling after a 429, breaker not open (or a free
        half-open slot). Standby backends only when no primary qualifies; backends
        suspected of hanging (silent on their probes and scrapes,
        :mod:`gateway.fleet.liveness`) only when nothing else does."""
        primaries: list[Backend] = []
        standbys: list[Backend] = []
        suspects: list[Backend] | None = None
        for b in self.fleet.backends:
            if (
                b.state is not BackendState.WARM
                or model not in b.models
                or b.id in tried
                or b.cooling_until > now
                or not b.breaker.can_take()
            ):
                continue
            if b.suspected:
                suspects = [b] if suspects is None else [*suspects, b]
                continue
            (standbys if b.is_standby else primaries).append(b)
        if primaries or standbys or suspects is None:
            return primaries or standbys
        return [b for b in suspects if not b.is_standby] or suspects

    def availability_s(self, model: str, now: float) -> float | None:
        """Seconds until some backend of ``model`` can take a request again (a 429 cooldown
        or an open breaker ending), or None when none is expected back soon (unhealthy,
        draining, gone)."""
        soonest: float | None = None
        for b in self.fleet.backends:
            if b.state is not BackendState.WARM or model not in b.models:
                continue
            wait = max(0.0, b.cooling_until - now, b.breaker.retry_in())
            soonest = wait if soonest is None else min(soonest, wait)
        return soonest

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

    async def open(self, ctx: RequestContext, bound: Backend | None = None) -> Opened | Response:
        """Find a backend whose answer starts well; the caller then sends it to the client.

        Returns :class:`Opened` (the caller owns ``resp`` and the backend's in-flight
        slot), or a final :class:`Response` when no attempt succeeded: the gateway's own
        429/503 when no backend can take the model now (with ``retry-after``), or a
        backend's own 5xx answer unchanged. Cancellation (client gone) propagates after
        releasing everything.

        The first attempt runs plainly (most requests need no other); retries go through
        :class:`gateway.traffic.retry.RetryPolicy` (full-jitter backoff, tenacity for the
        later ones) and must fit in the retry budget.
        """
        if bound is None and self.batching is not None:
            # wait in the batcher's bucket; it binds a backend with room (or answers: a
            # merged request's share, a 429 after the queue timeout)
            got = await self.batching.acquire(ctx)
            if isinstance(got, Response):
                return got
            bound = got
        self.budget.record_request()
        tried: list[str] = []
        max_attempts = self.cfg.proxy.max_attempts
        try:
            return await self._one(ctx, tried, bound)
        except UpstreamFailure as f:
            last = f
        except NoCandidate:
            return self._give_up(ctx, None)
        if not self._may_retry(last, len(tried), max_attempts):
            return self._give_up(ctx, last)
        self.retrying += 1  # between attempts: a shutdown's grace period waits for it
        try:
            return await self._retry(ctx, tried, last, max_attempts)
        finally:
            self.retrying -= 1

    async def _retry(
        self, ctx: RequestContext, tried: list[str], last: UpstreamFailure, max_attempts: int
    ) -> Opened | Response:
        """The attempts after the first failed one (backoff first)."""
        await self.retry.pause()
        if self.shutting_down:  # the grace period ended during the pause
            return self._give_up(ctx, last)

        def may_retry(e: BaseException) -> bool:
            return isinstance(e, UpstreamFailure) and self._may_retry(e, len(tried), max_attempts)

        try:
            async for attempt in self.retry.retrying(max_attempts - len(tried), may_retry):
                with attempt:
                    self.metrics.retries.labels(last.kind).inc()
                    try:
                        return await self._one(ctx, tried)
                    except UpstreamFailure as f:
                        last = f
                        raise
        except UpstreamFailure as f:
            return self._give_up(ctx, f)
        except NoCandidate:
            pass
        return self._give_up(ctx, last)

    def _may_retry(self, f: UpstreamFailure, attempts: int, max_attempts: int) -> bool:
        if self.shutting_down or not should_retry(f.kind, attempts, max_attempts):
            return False
        if f.kind == "backend_hung":
            # counted, never refused: it replaces an attempt the gateway cancelled on a
            # backend doing no work (gateway.traffic.retry, "hung backend")
            self.budget.spend()
            return True
        if self.budget.try_spend():
            return True
        self.metrics.retry_budget_exhausted.inc()
        return False

    async def _one(
        self, ctx: RequestContext, tried: list[str], bound: Backend | None = None
    ) -> Opened:
        """Pick a backend this request has not tried and run one attempt on it.

        Raises :class:`NoCandidate` when none is left, :class:`UpstreamFailure` when the
        attempt fails (already recorded in the breaker, metrics and backend state).
        """
        now = self.router_clock()
        backend = (
            bound
            if bound is not None  # bound by the batcher at dispatch
            else self.router.pick(self.candidates(ctx.model, tried, now), ctx.session_key)
        )
        if backend is None:
            raise NoCandidate
        tried.append(backend.id)
        breaker = backend.breaker
        breaker.acquire()
        if backend.in_flight == 0:
            backend.busy_since = now
        backend.take(ctx.places, ctx.pooled_extra)
        backend.active.add(ctx.cut)
        if len(tried) < self.cfg.proxy.max_attempts:
            # an attempt is left: a hung backend's watchdog may cut it to re-send it (one
            # without would only turn a wait into a 503)
            backend.awaiting[ctx.cut] = ctx.model
        try:
            opened = await self._attempt(backend, ctx)
            backend.last_answer_at = self.router_clock()
            backend.liveness.heard(backend.last_answer_at)
            return opened
        except UpstreamFailure as f:
            if f.status is not None:  # it answered, with an error: alive
                backend.liveness.heard(self.router_clock())
            self._release(backend, ctx)
            self._record_failure(f, ctx)
            raise
        except asyncio.CancelledError:
            self._release(backend, ctx)
            breaker.on_neutral()
            if ctx.cut.reason not in (Cut.DRAIN_DEADLINE, Cut.BACKEND_HUNG):
                raise
            # The gateway ended this attempt (its backend's drain deadline, or the backend
            # hung) before any byte reached the client: safe to send elsewhere.
            reason = ctx.cut.absorb()
            ctx.cut.rearm()
            if reason == Cut.BACKEND_HUNG:
                self._count_attempt(backend, "backend_hung")
                raise UpstreamFailure(
                    backend, "backend_hung", "backend hung before answering"
                ) from None
            self._count_attempt(backend, "drained")
            raise UpstreamFailure(backend, "drained", "backend left before answering") from None
        except BaseException:
            self._release(backend, ctx)
            breaker.on_neutral()
            raise
        finally:
            backend.awaiting.pop(ctx.cut, None)

    def _release(self, backend: Backend, ctx: RequestContext) -> None:
        """Give back the backend slot this request held (the batcher may dispatch into it)."""
        backend.give_back(ctx.places, ctx.pooled_extra)
        backend.active.discard(ctx.cut)
        if self.batching is not None:
            self.batching.slot_freed(ctx)

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
        sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(proxy.ttfb_timeout_s) as timer:
                resp = await self.pool.send(
                    backend, ctx.upstream, self.controller.api_keys[backend.id]
                )
                status = resp.status
                if ctx.stream and status == 200 and resp.content_type == _EVENT_STREAM:
                    framer = EventFramer()
                    first = await self._first_events(backend, resp, framer)
                    return Opened(backend, resp, first, framer, sent_at)
                waiting_first_byte = False
                body = await self._read_body(resp, timer, proxy.idle_timeout_s)
                # 401/403: the gateway's own key is wrong only when the probes found this
                # backend refusing it (``config_error``); then another backend may be set
                # up right. Otherwise it is about this request (case BUG-06): passed
                # through unchanged, like every 4xx, and never a breaker failure.
                if (
                    status == 429
                    or status >= 500
                    or (status in (401, 403) and backend.config_error is not None)
                ):
                    kind: FailureKind = (
                        "rate_limited" if status == 429 else "status" if status >= 500 else "auth"
                    )
                    if status in (429, 503):
                        self._cool(backend, resp.headers.get("retry-after"), status == 429)
                    raise UpstreamFailure(
                        backend,
                        kind,
                        f"backend answered {status}",
                        status,
                        body,
                        response_headers(resp, self.id_header),
                    )
                return Opened(backend, resp, body, None, sent_at)
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
        """Read until at least one complete event with a field is in (comments alone, such
        as ``: ping``, do not commit the stream: a failure after them may still be retried),
        under the caller's TTFB timer."""
        content = resp.content
        got: list[bytes] = []
        while True:
            chunk = await content.readany()
            if not chunk:
                raise UpstreamFailure(
                    backend, "disconnected", "stream ended before its first event"
                )
            out = framer.feed(chunk)
            if out:
                got.append(out)
                if has_event(out):
                    return out if len(got) == 1 else b"".join(got)

    def _cool(self, backend: Backend, retry_after: str | None, always: bool) -> None:
        """Honour a backend's ``Retry-After``: no request goes to it before then. A 429
        cools it even without the header (``retry.default_retry_after_s``)."""
        seconds = parse_retry_after(retry_after, self.controller.wall())
        if seconds is None:
            if not always:
                return
            seconds = self.cfg.retry.default_retry_after_s
        seconds = min(seconds, self.cfg.retry.max_cooling_s)
        until = self.router_clock() + seconds
        if until > backend.cooling_until:
            backend.cooling_until = until
            log.info("backend %s: cooling for %.1f s (Retry-After)", backend.id, seconds)

    def _record_failure(self, f: UpstreamFailure, ctx: RequestContext) -> None:
        """One failed attempt: metrics, the backend's last error, its breaker."""
        backend = f.backend
        self._count_attempt(backend, f.kind)
        backend.note_error(f"{ctx.endpoint}: {f.message}")
        if f.kind == "auth":
            self.controller._config_error(backend, f.message, f.status)
        if f.kind in ("rate_limited", "drained", "auth", "backend_hung"):
            backend.breaker.on_neutral()  # busy or ours to end: not a health signal
        else:
            self._breaker_failure(backend)
        log.info(
            "attempt on %s failed (%s): %s [request %s]",
            backend.id,
            f.kind,
            f.message,
            ctx.request_id,
        )

    def _breaker_failure(self, backend: Backend) -> None:
        breaker = backend.breaker
        was = breaker.state
        breaker.on_failure()
        if breaker.state is BreakerState.OPEN and was is not BreakerState.OPEN:
            self.controller.on_breaker_trip(backend)

    def _give_up(self, ctx: RequestContext, f: UpstreamFailure | None) -> Response:
        rid = ctx.request_id
        idh = self.cfg.server.request_id_header
        if f is None or f.kind == "rate_limited":
            return self.unavailable(ctx.model, rid)
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
        if f.kind in ("drained", "backend_hung"):
            return error_response(
                503,
                f"The backend serving model '{ctx.model}' was taken out of rotation "
                "(drained, hung, stalled or shutting down) before answering, and no other could "
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

    def unavailable(self, model: str, rid: str) -> Response:
        """The gateway's own answer when no backend of ``model`` can take a request now,
        sent without contacting any: 429 when one is warm but cooling after a 429/503 or
        with an open breaker (``retry-after`` is the wait until the first is back, rounded
        up, at most 60 s), else 503 (unhealthy, draining, gone) with the probe-recovery
        estimate."""
        idh = self.cfg.server.request_id_header
        soon = self.availability_s(model, self.router_clock())
        if soon is not None:
            soon = min(soon, MAX_RETRY_AFTER_S)
            return error_response(
                429,
                f"Every backend serving model '{model}' is rate-limited or recovering; retry "
                f"in {max(1, math.ceil(soon))} s.",
                "requests",
                "rate_limit_exceeded",
                retry_after_s=max(soon, 1.0),
                request_id=rid,
                id_header=idh,
            )
        return error_response(
            503,
            f"No backend is available for model '{model}' right now (all are unhealthy, "
            "draining or restarting).",
            SERVER_ERROR,
            "no_backend_available",
            retry_after_s=self.retry_after_s(),
            request_id=rid,
            id_header=idh,
        )

    # ---- completion -----------------------------------------------------------------------
    def finish_body(self, ctx: RequestContext, opened: Opened) -> Response:
        """The non-streaming answer for the client; releases the backend slot. Counts the
        attempt, not the client request: the caller observes the request's status and
        latency (a merged request's members are observed each, by their own callers)."""
        backend, resp, body = opened.backend, opened.resp, opened.data
        self._release(backend, ctx)
        self._served(backend)
        status = resp.status
        self._count_attempt(backend, "ok" if status < 400 else f"http_{status}")
        if status < 400:
            backend.breaker.on_success()
        else:
            backend.breaker.on_neutral()  # a 4xx caused by the request
        headers = response_headers(resp, self.id_header)
        resp.release()
        if status == 200 and resp.headers.get("content-encoding") is None:
            self._count_usage(ctx.model, extract_usage(body))
        headers.append((self.cfg.server.request_id_header.encode(), ctx.request_id.encode()))
        headers.extend(ctx.extra_headers)
        r = Response(body, status_code=status)
        r.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
        return r

    def relay(self, ctx: RequestContext, opened: Opened, watch: ClientWatch) -> RelayResponse:
        """The streaming answer for the client; the slot is released when the stream ends."""
        backend, resp = opened.backend, opened.resp
        headers = response_headers(opened.resp, self.id_header)
        headers.append((self.cfg.server.request_id_header.encode(), ctx.request_id.encode()))
        headers.extend(ctx.extra_headers)
        assert opened.framer is not None

        def on_done(outcome: str, framer: EventFramer, first_sent_at: float | None) -> None:
            self._release(backend, ctx)
            self.gate.release(ctx.ticket)
            self._served(backend)
            m = self.metrics
            ttft = None if first_sent_at is None else first_sent_at - ctx.started
            if ttft is not None:
                self.ttft_window.append((self.router_clock(), ttft))
            m.observe_latency(ctx.endpoint, ctx.model, ttft, time.perf_counter() - ctx.started)
            if outcome == StreamOutcome.CLIENT_GONE:
                m.client_disconnects.labels(ctx.endpoint).inc()
                m.count_request(ctx.endpoint, ctx.model, 499)
                self._count_attempt(backend, "client_gone")
                backend.breaker.on_neutral()
                return
            m.count_request(ctx.endpoint, ctx.model, 200)
            self._count_usage(ctx.model, framer.usage())
            if outcome == StreamOutcome.OK:
                self._count_attempt(backend, "ok")
                # the backend's own TTFT (from this attempt's send): time spent in the
                # gateway's queue or on an earlier attempt is not the backend's
                backend.breaker.on_success(
                    None if first_sent_at is None else first_sent_at - opened.sent_at
                )
            elif outcome in (Cut.DRAIN_DEADLINE, Cut.SHUTDOWN, Cut.BACKEND_HUNG):
                self._count_attempt(backend, outcome)  # ended by us, not the backend's fault
                m.stream_errors.labels(backend.id, outcome).inc()
                backend.breaker.on_neutral()
            else:
                self._count_attempt(backend, outcome)
                m.stream_errors.labels(backend.id, outcome).inc()
                backend.note_error(f"{ctx.endpoint}: stream ended with {outcome}")
                self._breaker_failure(backend)

        return RelayResponse(
            resp,
            headers,
            opened.data,
            opened.framer,
            watch,
            ctx.cut,
            self.cfg.proxy.idle_timeout_s,
            on_done,
            ends_with_done=ctx.endpoint in DONE_TERMINATED,
            heard=backend.liveness.heard,
        )

    def _count_usage(self, model: str, usage: tuple[int, int] | None) -> None:
        if usage is None:
            return
        prompt, completion = usage
        self.metrics.tokens.labels(model, "prompt").inc(prompt)
        self.metrics.tokens.labels(model, "completion").inc(completion)
