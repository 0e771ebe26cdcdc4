"""The attempts: pick a backend, forward, fail over, record the outcome.

``api/openai.py`` parses just enough of a request to build a
:class:`gateway.flow.context.RequestContext`; after admission (and the batcher's queue,
when on) :meth:`Pipeline.open` runs the attempts: the routing policy picks among the
candidates (:func:`gateway.flow.candidates.candidates`, never one this request already
tried), the transport sends the raw body (:func:`gateway.flow.attempt.send_attempt`), and
the answer is accepted once its start is known to be good (non-streams: the whole body;
streams: the first complete events). Until then nothing has reached the client, so a
connect error, a broken connection or a 5xx is retried on another backend
(:mod:`gateway.traffic.retry`). Every attempt's outcome feeds the passive health check
(the breaker, through the request's lease) and the metrics.

What the attempts cannot turn into an answer is raised typed: the last answer a backend
gave (its 429 or 5xx, :class:`gateway.core.outcomes.BackendAnswer`, relayed as sent), or,
when no backend answered, a :class:`gateway.core.outcomes.Refusal` (the gateway's own
429/502/503/504); the HTTP edge renders both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway import logs
from gateway.config import GatewayConfig
from gateway.core.outcomes import BackendAnswer, Refusal, stream_error_type
from gateway.core.vocab import Cut, FailureKind
from gateway.fleet.backend import Backend
from gateway.fleet.feedback import FleetFeedback
from gateway.fleet.fleet import Fleet
from gateway.flow.accounting import Accounting
from gateway.flow.attempt import send_attempt
from gateway.flow.candidates import candidates
from gateway.flow.context import (
    NOTHING_GENERATED,
    Answer,
    Opened,
    RequestContext,
    version_label,
)
from gateway.flow.lease import Hold, Verdict
from gateway.flow.outcome import give_up, kept_answer
from gateway.proxy.relay import StreamOutcome
from gateway.proxy.sse import EventFramer, extract_usage
from gateway.proxy.upstream import Transport, UpstreamFailure, response_headers
from gateway.routing.policies import Policy
from gateway.tracing import end_attempt
from gateway.traffic.retry import RetryBudget, RetryPolicy, should_retry
from gateway.traffic.retry_after import backend_retry_after

log = logging.getLogger("gateway.flow.pipeline")

# Failures that say nothing about the backend's health: busy, or ended by the gateway
_NEUTRAL_FAILURES = frozenset(
    {FailureKind.RATE_LIMITED, FailureKind.DRAINED, FailureKind.AUTH, FailureKind.BACKEND_HUNG}
)
# Failures that carry a backend's answer for the client (429, 5xx); not AUTH: a 401/403 to
# the gateway's own backend key is the gateway's configuration error, not the client's
_RELAYED = frozenset({FailureKind.RATE_LIMITED, FailureKind.STATUS})
# Stream ends the gateway caused (not the backend's fault)
_OURS = frozenset({Cut.DRAIN_DEADLINE, Cut.SHUTDOWN, Cut.BACKEND_HUNG, StreamOutcome.CANCELLED})


class NoCandidate(Exception):
    """No backend this request has not tried can take it now."""


class Pipeline:
    """Runs requests' attempts against the fleet; one per app, built by
    :func:`gateway.wiring.build_gateway`. ``clock``: monotonic seconds; ``wall``: Unix
    seconds (for ``Retry-After`` dates)."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        router: Policy,
        transport: Transport,
        signals: FleetFeedback,
        accounting: Accounting,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.router = router
        self.transport = transport
        self.signals = signals
        self.accounting = accounting
        self.clock = clock
        self.wall = wall
        self.id_header = cfg.server.request_id_header.lower()
        r = cfg.retry
        self.retry = RetryPolicy(r.backoff_base_s, r.backoff_max_s)
        self.shutting_down = False  # the shutdown's grace period is over: no new attempt
        self.retrying = 0  # requests between two attempts (backoff) or on a retry
        self.budget = RetryBudget(r.budget_ratio, r.budget_window_s, r.budget_min_per_s, clock)

    # ---- attempts -----------------------------------------------------------------------
    async def open(self, ctx: RequestContext, bound: Backend | None = None) -> Opened:
        """Find a backend whose answer starts well; the caller then sends it to the client.

        ``bound``: the backend the batcher dispatched the request to (its first attempt
        goes there). Returns :class:`Opened` (its attempt stays open on ``ctx.lease``, and
        the lease holds the response). Raises :class:`Refusal` (no backend can take the
        model now: 429/503 with the seconds until one may; the last attempt failed
        without an answer: 502/503/504) or :class:`BackendAnswer` (the last 429 or 5xx a
        backend answered, passed on as sent).
        Cancellation (client gone) propagates; the lease gives everything back.

        The first attempt runs plainly (most requests need no other); retries go through
        :class:`gateway.traffic.retry.RetryPolicy` (full-jitter backoff, tenacity for the
        later ones) and must fit in the retry budget.
        """
        self.budget.record_request()
        tried = ctx.tried
        max_attempts = self._max_attempts(ctx)
        try:
            return await self._one(ctx, tried, bound)
        except UpstreamFailure as f:
            last = f
        except NoCandidate:
            raise self._give_up(ctx, None) from None
        if not self._may_retry(last, self._attempts(ctx), max_attempts):
            raise self._give_up(ctx, last)
        self.retrying += 1  # between attempts: a shutdown's grace period waits for it
        try:
            return await self._retry(ctx, tried, last, max_attempts)
        finally:
            self.retrying -= 1

    async def _retry(
        self, ctx: RequestContext, tried: list[str], last: UpstreamFailure, max_attempts: int
    ) -> Opened:
        """The attempts after the first failed one (backoff first)."""
        await self.retry.pause()
        if self.shutting_down:  # the grace period ended during the pause
            raise self._give_up(ctx, last)

        def may_retry(e: BaseException) -> bool:
            return isinstance(e, UpstreamFailure) and self._may_retry(
                e, self._attempts(ctx), max_attempts)

        # (an upper bound: may_retry and the candidates left end it, each retry within the
        # retry budget; connect failures do not count toward max_attempts)
        more = max_attempts - self._attempts(ctx) + len(self.fleet.backends)
        try:
            async for attempt in self.retry.retrying(more, may_retry):
                with attempt:
                    self.accounting.metrics.retries.labels(last.kind).inc()
                    try:
                        return await self._one(ctx, tried)
                    except UpstreamFailure as f:
                        last = f
                        raise
        except UpstreamFailure as f:
            raise self._give_up(ctx, f) from None
        except NoCandidate:
            pass
        raise self._give_up(ctx, last)

    def _may_retry(self, f: UpstreamFailure, attempts: int, max_attempts: int) -> bool:
        if self.shutting_down or not should_retry(f.kind, attempts, max_attempts):
            return False
        if f.kind == FailureKind.BACKEND_HUNG:
            # counted, never refused: it replaces an attempt the gateway cancelled on a
            # backend doing no work (gateway.traffic.retry, "hung backend")
            self.budget.spend()
            return True
        if self.budget.try_spend():
            return True
        self.accounting.metrics.retry_budget_exhausted.inc()
        return False

    @staticmethod
    def _attempts(ctx: RequestContext) -> int:
        """The attempts of ``ctx`` that count toward ``proxy.max_attempts``: those that
        reached a backend. One that found no connection sent nothing (a dead or restarting
        server: connection refused, or no connection within ``proxy.connect_timeout_s``), so
        trying another backend is always safe, as nginx's ``proxy_next_upstream error``
        does: with 2 of 4 servers just killed and ``max_attempts`` 2, a new user's trial saw
        requests whose two attempts both met a dead server answered 502 while 2 served.
        Each retry still spends the retry budget, and a request tries each backend once."""
        return len(ctx.tried) - ctx.unreached

    def _max_attempts(self, ctx: RequestContext) -> int:
        """Attempts ``ctx`` may take: one for a request pinned to its backend."""
        return 1 if ctx.pinned is not None else self.cfg.proxy.max_attempts

    async def _one(
        self, ctx: RequestContext, tried: list[str], bound: Backend | None = None
    ) -> Opened:
        """Pick a backend this request has not tried and run one attempt on it (a pinned
        request's own backend, ``ctx.pinned``, unless bound by the batcher).

        Raises :class:`NoCandidate` when none is left, :class:`UpstreamFailure` when the
        attempt fails (its attempt already ended on the lease, recorded in the metrics).
        """
        now = self.clock()
        if bound is not None:  # bound by the batcher at dispatch
            backend: Backend | None = bound
        elif ctx.pinned is not None:
            backend = ctx.pinned if ctx.pinned.id not in tried else None
        else:
            backend = self.router.pick(
                candidates(self.fleet, ctx.model, tried, now, ctx.version,
                           ctx.fallback_version), ctx.session_key
            )
        if backend is None:
            raise NoCandidate
        tried.append(backend.id)
        if logs.FIELDS_ON:  # on the request's log lines from here (JSON lines)
            logs.BACKEND.set(backend.id)
        trace = ctx.trace
        span = None if trace is None else trace.attempt(
            backend.id, len(tried), ctx.upstream.headers)
        lease = ctx.lease
        # an attempt left: a hung backend's watchdog may cut this one to re-send it (one
        # without would only turn a wait into a 503)
        resendable = ctx.model if self._attempts(ctx) < self._max_attempts(ctx) else None
        lease.start_attempt(backend, ctx.cut, ctx.places, ctx.pooled_extra, now, resendable)
        try:
            opened = await send_attempt(
                self.transport, backend, ctx, self.cfg.proxy, self.id_header
            )
        except UpstreamFailure as f:
            if span is not None:
                end_attempt(span, f.kind, f.status)
            if f.status is not None:  # it answered, with an error: alive
                backend.heard(self.clock())
            if f.kind == FailureKind.CONNECT:
                ctx.unreached += 1
            self._failed(backend, f, ctx)
            raise
        except asyncio.CancelledError:
            if span is not None:
                end_attempt(span, ctx.cut.reason or "cancelled")
            lease.end_attempt(Verdict.NEUTRAL)
            if ctx.cut.reason not in (Cut.DRAIN_DEADLINE, Cut.BACKEND_HUNG):
                raise
            # The gateway ended this attempt (its backend's drain deadline, or the backend
            # hung) before any byte reached the client: safe to send elsewhere.
            reason = ctx.cut.absorb()
            ctx.cut.rearm()
            if reason == Cut.BACKEND_HUNG:
                self.accounting.attempt(backend, FailureKind.BACKEND_HUNG)
                raise UpstreamFailure(
                    backend, FailureKind.BACKEND_HUNG, "backend hung before answering"
                ) from None
            self.accounting.attempt(backend, FailureKind.DRAINED)
            raise UpstreamFailure(
                backend, FailureKind.DRAINED, "backend left before answering"
            ) from None
        if span is not None:
            end_attempt(span, "opened", opened.resp.status)
        backend.answer_started(ctx.cut, self.clock())
        lease.hold(Hold.RESPONSE, opened.resp.close)
        return opened

    def _failed(self, backend: Backend, f: UpstreamFailure, ctx: RequestContext) -> None:
        """One failed attempt: honour a Retry-After, keep the backend's answer (its 429 or
        5xx: relayed if no backend takes the request), end the attempt on the lease with
        the breaker's verdict, count it, remember the error, and tell the fleet of an auth
        refusal."""
        if f.status in (429, 503):
            self._cool(backend, f.headers, f.status == 429)
        if f.kind in _RELAYED and f.status is not None:
            new = BackendAnswer(f.status, f.body, f.headers, version=version_label(backend))
            ctx.answered = kept_answer(ctx.answered, new, self.wall())
        ctx.lease.end_attempt(Verdict.NEUTRAL if f.kind in _NEUTRAL_FAILURES else Verdict.FAILURE)
        self.accounting.attempt(backend, f.kind)
        backend.note_error(f"{ctx.endpoint}: {f.message}")
        if f.kind == FailureKind.AUTH:
            self.signals.auth_refused(backend, f.message, f.status)
        log.info(
            "attempt on %s failed (%s): %s [request %s]",
            backend.id,
            f.kind,
            f.message,
            ctx.request_id,
        )

    def _cool(self, backend: Backend, headers: list[tuple[bytes, bytes]], always: bool) -> None:
        """Honour a backend's ``Retry-After`` or ``retry-after-ms`` (``headers``: its answer's,
        :func:`gateway.traffic.retry_after.backend_retry_after`): no request goes to it before
        then. A 429 cools it even without a readable one (``retry.default_retry_after_s``)."""
        seconds = backend_retry_after(headers, self.wall())
        if seconds is None:
            if not always:
                return
            seconds = self.cfg.retry.default_retry_after_s
        seconds = min(seconds, self.cfg.retry.max_cooling_s)
        if backend.cool_until(self.clock() + seconds):
            log.info("backend %s: cooling for %.1f s (Retry-After)", backend.id, seconds)

    # ---- continuation (issue 17, gateway.flow.continuing) -------------------------------
    def stream_failed(self, ctx: RequestContext, opened: Opened, code: str) -> None:
        """A stream's attempt failed mid-stream with ``code`` and is to be continued: count
        it, end it as a breaker failure (a broken stream is the backend's; a drain deadline,
        ``Cut.DRAIN_DEADLINE``, is the gateway's own doing: neutral), and drop the response
        from the lease (the relay closed it)."""
        backend = opened.backend
        ctx.lease.hand_over(Hold.RESPONSE)
        self.accounting.attempt(backend, code)
        if code in _OURS:
            ctx.lease.end_attempt(Verdict.NEUTRAL)
            return
        backend.note_error(f"{ctx.endpoint}: stream ended with {code} (continued)")
        ctx.lease.end_attempt(Verdict.FAILURE)

    async def reopen(self, ctx: RequestContext, code: str) -> Opened | str:
        """One continuation attempt of ``ctx`` (its ``upstream.body`` already the
        continuation's) on a backend it has not tried, if the retry budget allows one.
        Returns why not when none was made (``shutdown``, ``no_budget``: the retry budget
        is spent, ``no_backend``: none of the model left untried); raises
        :class:`UpstreamFailure` when the attempt failed (recorded: another may be tried)."""
        if self.shutting_down:
            return "shutdown"
        if not self.budget.try_spend():
            self.accounting.metrics.retry_budget_exhausted.inc()
            return "no_budget"
        self.accounting.metrics.retries.labels(code).inc()
        try:
            return await self._one(ctx, ctx.tried)
        except NoCandidate:
            return "no_backend"

    # ---- what cannot be answered ------------------------------------------------------
    def _give_up(self, ctx: RequestContext, f: UpstreamFailure | None) -> Refusal | BackendAnswer:
        """The typed outcome when no attempt gave an answer the client can have
        (:func:`gateway.flow.outcome.give_up`)."""
        return give_up(ctx, f, self.fleet, self.cfg.health, self.clock())

    # ---- completion ---------------------------------------------------------------------
    def finish_body(self, ctx: RequestContext, opened: Opened) -> Answer:
        """The non-streaming answer for the client; ends the attempt on the lease. Counts
        the attempt, not the client request: the caller observes the request's status and
        latency (a merged request's members are observed each, by their own callers), with
        the answer's ``version`` (``backend``'s label, :func:`version_label`)."""
        backend, resp, body = opened.backend, opened.resp, opened.data
        status = resp.status
        lease = ctx.lease
        # a 4xx is about the request, not the backend's health
        lease.end_attempt(Verdict.SUCCESS if status < 400 else Verdict.NEUTRAL)
        self.accounting.served(backend)
        self.accounting.attempt(backend, "ok" if status < 400 else f"http_{status}")
        headers = response_headers(resp, self.id_header)
        lease.hand_over(Hold.RESPONSE)
        resp.release()
        if status == 200 and resp.headers.get("content-encoding") is None:
            usage = extract_usage(body)
            self.accounting.usage(ctx.model, usage, backend)
            ctx.settle(usage)  # the key is charged the usage, not the estimate
        elif status >= 400:  # the backend refused the request: nothing was generated
            ctx.settle(NOTHING_GENERATED)
        return Answer(status, body, headers, version_label(backend))

    def stream_done(
        self,
        ctx: RequestContext,
        opened: Opened,
        outcome: str,
        framer: EventFramer,
        first_sent_at: float | None,
        *,
        usage: tuple[int, int] | None = None,
        continued: bool = False,
        recorded: bool = False,
        first_backend: Backend | None = None,
    ) -> None:
        """A relayed stream ended with ``outcome`` (``ok``, ``in_band_error``, a
        :class:`Cut` reason or the error code the client saw; ``first_sent_at``:
        ``time.perf_counter()`` when its first bytes went out): record it, end the attempt
        with the breaker's verdict, and close the lease (ticket and all), before the
        stream's last bytes go out.

        An in-band error (``framer.error``) is counted under its own status (its numeric
        code when a 4xx/5xx, else 500) and attempt outcome ``in_band_error``, logged with
        the request id, and neutral to the breaker; an incomplete stream
        (``upstream_incomplete``: no ``[DONE]`` or terminal event) is a stream error and a
        breaker failure, like a broken one.

        A continued stream (issue 17, :mod:`gateway.flow.continuing`): ``opened`` is its
        last attempt, ``usage`` what the client was given (else the framer's), ``continued``
        (the backend's own TTFT is unknown: none is recorded), ``recorded`` (the last
        attempt was already ended: a continuation that found no backend).

        The request is counted in ``gateway_requests_total`` under the ``model_version`` of
        ``opened.backend`` (:func:`version_label`): for a continued stream, the backend of
        its last attempt, the one that finished it. Its TTFT goes in
        ``gateway_ttft_seconds`` under the backend whose events the client got first
        (``first_backend``, a continued stream's first attempt; default ``opened``'s), and
        an end other than ``ok`` in ``gateway_request_errors_total``
        (:func:`gateway.core.outcomes.stream_error_type`)."""
        backend = opened.backend
        if ctx.trace is not None:  # the relay span's outcome (gateway.tracing)
            ctx.trace.outcome = outcome
        if usage is None:
            usage = framer.usage()
        acc = self.accounting
        m = acc.metrics
        lease = ctx.lease
        lease.hand_over(Hold.RESPONSE)  # the relay released or closed it
        acc.served(backend)
        ttft = None if first_sent_at is None else first_sent_at - ctx.started
        if ttft is not None:
            acc.stream_started(ttft, ctx.model)
            first = first_backend if first_backend is not None else backend
            m.stream_children(ctx.model, first.id)[0].observe(ttft)
        acc.request_latency(ctx.endpoint, ctx.model, ttft, ctx.started)
        error = stream_error_type(outcome)
        if error is not None and (outcome != StreamOutcome.IN_BAND_ERROR or framer.error):
            m.count_error(ctx.model, error)
        if outcome == StreamOutcome.CLIENT_GONE:
            m.client_disconnects.labels(ctx.endpoint).inc()
            m.count_request(ctx.endpoint, ctx.model, 499, version_label(backend))
            if not recorded:
                acc.attempt(backend, Cut.CLIENT_GONE)
                lease.end_attempt(Verdict.NEUTRAL)
        elif outcome == StreamOutcome.IN_BAND_ERROR and framer.error is not None:
            # a request error the backend reported inside its 200 stream: about the
            # request, not the backend's health
            acc.in_band_error(ctx.endpoint, ctx.model, backend, framer.error, ctx.request_id)
            acc.usage(ctx.model, usage, backend)
            lease.end_attempt(Verdict.NEUTRAL)
        else:
            m.count_request(ctx.endpoint, ctx.model, 200, version_label(backend))
            acc.usage(ctx.model, usage, backend)
            ctx.settle(usage)  # the key is charged the usage, not the estimate
            if recorded:  # its attempt was counted when it failed (stream_failed)
                if outcome != StreamOutcome.OK:
                    m.stream_errors.labels(backend.id, outcome).inc()
            elif outcome == StreamOutcome.OK:
                acc.attempt(backend, outcome)
                # the backend's own TTFT (from this attempt's send): time spent in the
                # gateway's queue or on an earlier attempt is not the backend's (a
                # continuation's first event is not a first token: none)
                own = None
                if first_sent_at is not None and not continued:
                    own = first_sent_at - opened.sent_at
                lease.end_attempt(Verdict.SUCCESS, own)
            elif outcome in _OURS:  # ended by us, not the backend's fault
                acc.attempt(backend, outcome)
                m.stream_errors.labels(backend.id, outcome).inc()
                lease.end_attempt(Verdict.NEUTRAL)
            else:
                acc.attempt(backend, outcome)
                m.stream_errors.labels(backend.id, outcome).inc()
                backend.note_error(f"{ctx.endpoint}: stream ended with {outcome}")
                lease.end_attempt(Verdict.FAILURE)
        lease.close()

