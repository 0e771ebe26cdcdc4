"""The admission gate: the I/O side of :mod:`gateway.traffic.admission`.

For each request, in order: the **entry** layer (the client key's requests/min and
tokens/min buckets), degraded mode's refusal of long low-priority prompts, the **resource**
layer (the queue wait a new request would meet on the model's least-loaded backend, over
the TTFT SLO: shed by priority), the **power** layer (every power
domain that could serve the model over budget: shed by priority, :meth:`_check_power`),
then the **scheduler** layer (a
slot among ``max_in_flight``, or a wait in the priority queue, at most
``max_queue_wait_s``). A refusal is a 429 in OpenAI's shape with ``retry-after``,
``retry-after-ms`` and, where the key has limits, OpenAI's ``x-ratelimit-*`` headers.

Every admitted request holds a :class:`Ticket` until it ends, on its lease
(:mod:`gateway.flow.lease`); releasing it hands the slot to the most urgent waiter.
Refusals are raised as :class:`gateway.core.outcomes.Refusal` (the HTTP edge renders them).

The tokens-per-minute charge is an estimate (:mod:`gateway.traffic.estimate`); an admitted
request under a key with limits gets a :class:`Charge`, which the flow settles once the
answer's ``usage`` is known (:meth:`gateway.flow.key_limits.KeyLimits.settle`): the key is
then charged what the backend reported, not the estimate. Without a reported usage the
estimate stands.

In fleet mode the entry layer's limits are global (:mod:`gateway.traffic.quota`): a request
is admitted from this replica's local quota; one that finds it empty while the global
bucket seems to hold enough waits for the running fetch, at most
``coordination.quota_wait_s`` (the only wait on the store a request can meet, and never on a
store that is down), then is admitted or refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import ClientKey, GatewayConfig, Priority
from gateway.core.outcomes import Refusal, shutting_down
from gateway.core.vocab import BackendState, ErrorType, Prio
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.flow.key_limits import Charge, KeyLimits
from gateway.flow.lease import Hold, RequestLease
from gateway.flow.shaping import ratelimit_headers
from gateway.metrics import GatewayMetrics
from gateway.routing.policy import estimated_load
from gateway.traffic.admission import (
    DegradedMode,
    Saturation,
    pool_wait,
    shed,
    shed_retry_after,
    wait_level,
)
from gateway.traffic.estimate import MediaCosts
from gateway.traffic.limits import EntryVerdict
from gateway.traffic.scheduler import QUEUE_FULL, Scheduler

log = logging.getLogger("gateway.admission")

_PRIO_NAMES = {Prio.HIGH: "high", Prio.NORMAL: "normal", Prio.LOW: "low"}


@dataclass(slots=True)
class Ticket:
    """An admitted request's slot; :meth:`AdmissionGate.release` gives it back once."""

    prio: Prio
    started: float | None = None  # monotonic seconds when the slot was taken
    released: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class Waiter:
    """A request queued for a slot: its class and the future its slot is handed through
    (the scheduler keeps waiters opaque; a woken one that gave up meanwhile gives its slot
    back in its own class)."""

    prio: Prio
    fut: asyncio.Future[None]


class AdmissionGate:
    """One per app. ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        power_level: Callable[[Sequence[Backend], float], float] | None = None,
    ) -> None:
        self.cfg = cfg
        a = cfg.admission
        self.enabled = a.enabled
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        max_in_flight = a.max_in_flight
        if max_in_flight is None:
            max_in_flight = self._derived_capacity()
        capacity = max_in_flight
        self.fleet_capacity = capacity  # slots one gateway allows (fleet mode splits them)
        if cfg.batcher.enabled:
            # The batcher's buckets are the queue (gateway.flow.batching): it bounds in-flight per
            # backend and applies max_queued and max_queue_wait_s; no second queue here.
            # The scheduler still measures the service rate (for its predictions) over the
            # fleet's capacity.
            max_in_flight = None
        self.scheduler = Scheduler(
            max_in_flight, a.max_queued, max_wait_s=a.max_queue_wait_s, capacity=capacity
        )
        self.keys = KeyLimits(a, clock)  # the entry layer's buckets, per client key or IP
        e = a.estimate  # per-item token costs of media in the estimate
        self.media_costs = MediaCosts(e.image_tokens, e.audio_tokens, e.video_tokens, e.file_tokens)
        d = cfg.degraded
        self.degraded = DegradedMode(d.enter_after_s, d.step_s) if d.enabled else None
        # Power layer: draw / budget of the roomiest power domain among a model's routable
        # backends (gateway.fleet.gpu_monitor.GpuMonitor.power_level); None: no domains.
        self.power_level = power_level

    def _derived_capacity(self) -> int | None:
        """The in-flight bound from the fleet as it is now: ``sum(max_num_seqs) x
        admission.in_flight_per_seq`` when every backend states its ``max_num_seqs``, else
        None (unbounded here: the backends' own queues and the resource layer bound it)."""
        caps = [b.config.max_num_seqs for b in self.fleet]
        if not caps or any(c is None for c in caps):
            return None
        known = [c for c in caps if c is not None]
        return max(1, math.ceil(sum(known) * self.cfg.admission.in_flight_per_seq))

    def reconfigure(self, cfg: GatewayConfig) -> None:
        """A live reload changed ``admission`` (:mod:`gateway.reloading`): the next request
        is judged by the new limits, queue bounds and token estimate; requests already
        admitted or queued keep their place. A new ``max_in_flight`` (or, derived, a new
        ``in_flight_per_seq``) resizes the scheduler as :meth:`fleet_changed` does (waiters
        woken when it grows); new default rates start every client's buckets full
        (:meth:`KeyLimits.reconfigure`)."""
        old, self.cfg = self.cfg.admission, cfg
        a = cfg.admission
        self.enabled = a.enabled
        self.keys.reconfigure(a)
        e = a.estimate
        self.media_costs = MediaCosts(e.image_tokens, e.audio_tokens, e.video_tokens, e.file_tokens)
        sched = self.scheduler
        sched.max_queued = a.max_queued
        sched.max_wait_s = a.max_queue_wait_s
        if a.max_in_flight == old.max_in_flight and a.in_flight_per_seq == old.in_flight_per_seq:
            return
        capacity = a.max_in_flight if a.max_in_flight is not None else self._derived_capacity()
        self._resize(capacity)

    def fleet_changed(self, resize: bool = True) -> None:
        """The fleet's membership changed (discovery): the capacity derived from its
        ``max_num_seqs`` follows (a configured ``admission.max_in_flight`` stays). With
        ``resize`` (not in fleet mode's capacity shares, which resize it themselves each
        round from :attr:`fleet_capacity`) the scheduler's bound moves now: waiters are
        woken when it grows or goes, a lower one cuts nothing."""
        if self.cfg.admission.max_in_flight is not None:
            return
        capacity = self._derived_capacity()
        if capacity == self.fleet_capacity:
            return
        self.fleet_capacity = capacity
        if not resize:
            return
        self._resize(capacity)

    def _resize(self, capacity: int | None) -> None:
        """The scheduler's in-flight bound becomes ``capacity`` (None: unbounded); waiters
        are woken when it grows or goes, a lower one cuts nothing."""
        self.fleet_capacity = capacity
        sched = self.scheduler
        if self.cfg.batcher.enabled:  # the batcher bounds per backend: the rate's capacity
            sched.capacity = capacity
            return
        now = self.clock()
        woken = sched.resize(capacity, now) if capacity is not None else sched.unbound(now)
        self._wake(woken)

    # ---- helpers -------------------------------------------------------------------------
    def priority(self, header: bytes | None, key: ClientKey | None,
                 anonymous_max: Priority = Priority.NORMAL) -> Prio:
        """The priority a request is served at: its ``x-priority`` header, else the key's
        priority, else normal; bounded by what was granted (issue 20): the key's
        ``max_priority`` (default its ``priority``), for a request without a key
        ``anonymous_max`` (``auth.anonymous_max_priority``). A header asking for more is
        served at the bound and counted in ``gateway_priority_capped_total`` (label
        ``key``: the key's name, ``anonymous`` without one)."""
        default = Prio.parse(key.priority.value, Prio.NORMAL) if key else Prio.NORMAL
        bound = Prio.parse((key.bound if key else anonymous_max).value, Prio.NORMAL)
        asked = Prio.parse(header.decode("latin-1") if header else None, default)
        granted = asked.within(bound)
        if granted != asked and header:
            self.metrics.priority_capped.labels(
                key.name if key else "anonymous", asked.label, granted.label).inc()
        return granted

    def refusal(
        self,
        layer: str,
        prio: Prio,
        message: str,
        retry_s: float,
        verdict: EntryVerdict | None,
        request_id: str,
        code: str = "rate_limit_exceeded",
        type_: str | None = None,
        retryable: bool = True,
    ) -> Refusal:
        """A 429 from admission ``layer`` (``entry``, ``degraded``, ``resource``, ``power``,
        ``scheduler``; the batcher's queue counts as ``scheduler``), counted in
        ``gateway_admission_rejections_total`` and logged. ``retry_s``: the estimated
        seconds until a retry may be let in; ``verdict`` adds the key's ``x-ratelimit-*``
        headers."""
        self.metrics.admission_rejections.labels(layer, _PRIO_NAMES[prio]).inc()
        log.info(
            "admission %s refused a %s request: %s [request %s]",
            layer,
            _PRIO_NAMES[prio],
            message,
            request_id,
        )
        return Refusal(
            429,
            message,
            type_ or ("requests" if layer == "entry" else "server_overloaded"),
            code,
            retry_after_s=retry_s,
            retryable=retryable,
            headers=list(ratelimit_headers(verdict).items()) if verdict is not None else None,
            # the key's own limits are a rate limit; every other layer refused on load
            error_type=ErrorType.RATE_LIMITED if layer == "entry" else ErrorType.ADMISSION_REFUSED,
        )

    # ---- the gate ---------------------------------------------------------------------------
    async def admit(
        self,
        model: str,
        key_name: str,
        key: ClientKey | None,
        prio: Prio,
        est_tokens: int,
        prompt_tokens: int,
        request_id: str,
        lease: RequestLease,
    ) -> Charge | None:
        """Admit one request or raise :class:`Refusal` (a 429; a 503 when shutting down).

        ``est_tokens``: the whole estimate (prompt and completion budget) charged to the
        key; ``prompt_tokens``: the prompt's estimate (degraded mode's length check). The
        ticket goes on ``lease`` (given back when the request ends). Returns the key's
        :class:`Charge` (its verdict gives the ``x-ratelimit-*`` headers; settle it with
        the answer's usage), or None without limits or when admission is off.
        """
        if not self.enabled:
            return None
        now = self.clock()
        verdict = None
        limiter = self.keys.limiter(key_name, key)
        if limiter is not None:
            verdict = limiter.check(est_tokens, now)
            if verdict.pending:  # fleet mode: the local quota is being refilled
                await self.keys.refilled(limiter)
                now = self.clock()
                verdict = limiter.check(est_tokens, now, final=True)
            if not verdict.admitted:
                never = math.isinf(verdict.retry_after_s)
                raise self.refusal(
                    "entry",
                    prio,
                    f"Rate limit reached for key '{key_name}': {verdict.reason}"
                    + (
                        f" ({verdict.limit_tokens}); lower max_tokens or the prompt."
                        if never
                        else f". Retry in {verdict.retry_after_s:.1f} s."
                    ),
                    verdict.retry_after_s,
                    verdict,
                    request_id,
                    type_="tokens" if "token" in verdict.reason else "requests",
                    retryable=not never,  # it can never fit: a retry cannot help
                )
        try:
            ticket = await self._after_entry(model, prio, prompt_tokens, request_id, verdict, now)
        except (Refusal, asyncio.CancelledError):
            if limiter is not None:  # refused (or gone) later: the key's quota is given back
                limiter.refund(est_tokens, self.clock())
            raise
        lease.hold(Hold.TICKET, lambda: self.release(ticket))
        if limiter is None or verdict is None:
            return None
        return Charge(self.keys, key_name, limiter, est_tokens, verdict)

    def check_entry(
        self, key_name: str, key: ClientKey | None, prio: Prio, request_id: str
    ) -> EntryVerdict | None:
        """The entry layer alone, for a request that starts no generation (a Responses
        by-id call, :mod:`gateway.api.responses`): one request taken from the key's
        requests-per-minute bucket, 0 tokens (a key's tokens-per-minute deficit does not
        refuse it). In fleet mode it never waits: with the key's local quota empty it is
        refused (the fetch it starts serves the retry). Raises the entry layer's 429
        :class:`Refusal` (``retry-after`` and the key's ``x-ratelimit-*`` headers) when the
        key is out of requests. Returns the key's buckets after the charge (their headers),
        or None without limits or when admission is off."""
        if not self.enabled:
            return None
        limiter = self.keys.limiter(key_name, key)
        if limiter is None:
            return None
        now = self.clock()
        wait = limiter.take_request(now)  # the tokens bucket is not asked: it costs none
        if wait > 0:
            raise self.refusal(
                "entry",
                prio,
                f"Rate limit reached for key '{key_name}': requests per minute. "
                f"Retry in {wait:.1f} s.",
                wait,
                limiter.state(now),
                request_id,
            )
        return limiter.state(now)

    async def _after_entry(
        self,
        model: str,
        prio: Prio,
        prompt_tokens: int,
        request_id: str,
        verdict: EntryVerdict | None,
        now: float,
    ) -> Ticket:
        """Degraded mode, resource, power and scheduler layers (see :meth:`admit`)."""
        if (
            self.degraded is not None
            and self.degraded.level > 0
            and prio is Prio.LOW
            and prompt_tokens > self.cfg.degraded.low_priority_max_prompt_tokens
        ):
            raise self.refusal(
                "degraded",
                prio,
                "The gateway is overloaded (degraded mode): low-priority "
                f"prompts above {self.cfg.degraded.low_priority_max_prompt_tokens} tokens "
                "are refused for now.",
                self.cfg.degraded.step_s,
                verdict,
                request_id,
            )
        saturation, wait_s = self.saturation(model, now)
        a = self.cfg.admission
        if shed(prio, saturation, a.shed_levels):
            slo = self.cfg.slo.ttft_s
            bound = a.shed_levels[prio] * slo
            raise self.refusal(
                "resource",
                prio,
                f"The backends serving '{model}' are overloaded: a new request would wait "
                f"about {wait_s:.1f} s in their queues before it starts, over the "
                f"{bound:g} s ({a.shed_levels[prio]:g} x the {slo:g} s TTFT SLO) allowed to "
                f"{_PRIO_NAMES[prio]}-priority requests (low priority is shed first, high "
                "last).",
                shed_retry_after(wait_s, a.shed_levels[prio], slo),
                verdict,
                request_id,
            )
        if self.power_level is not None:
            self._check_power(model, prio, now, verdict, request_id)
        return await self._schedule(prio, verdict, request_id)

    def _check_power(
        self, model: str, prio: Prio, now: float, verdict: EntryVerdict | None, request_id: str
    ) -> None:
        """Power layer: when every power domain that could serve ``model`` is over its
        target (steering can no longer help), shed by priority before the facility caps
        power: low at ``thermal.power_shed_levels[2]`` (80%) of budget, then normal, high."""
        assert self.power_level is not None
        routable = [
            b for b in self.fleet.backends if b.state is BackendState.WARM and model in b.models
        ]
        level = self.power_level(routable, now)
        t = self.cfg.thermal
        if level > 0 and shed(prio, Saturation(level), t.power_shed_levels):
            raise self.refusal(
                "power",
                prio,
                f"The power domains of the backends serving '{model}' draw {level:.0%} of "
                f"their budget; {_PRIO_NAMES[prio]}-priority requests are refused until "
                "their draw falls.",
                2 * t.scrape_interval_s,
                verdict,
                request_id,
            )

    def saturation(self, model: str, now: float) -> tuple[Saturation, float]:
        """Saturation of the routable backends of ``model`` (:func:`wait_level`) and the
        predicted queue wait (seconds) on the least-loaded of them. Each backend's wait
        comes from its scraped queue, corrected by the gateway's in-flight changes since
        (:func:`gateway.routing.policy.estimated_load`), over its learned service rate."""
        stale = self.cfg.telemetry.stale_after_s
        waits = []
        for b in self.fleet.backends:
            if b.state is BackendState.WARM and model in b.models:
                waiting, running, _kv = estimated_load(b, now, stale)
                waits.append(b.service.predicted_wait(waiting, running))
        wait_s = pool_wait(waits)
        return wait_level(wait_s, self.cfg.slo.ttft_s), wait_s

    async def _schedule(self, prio: Prio, verdict: EntryVerdict | None, request_id: str) -> Ticket:
        sched = self.scheduler
        now = self.clock()
        decision = sched.offer(prio, now)
        if decision.action == "run":
            return Ticket(prio, now)
        if decision.action == "reject":
            full = sched.queued >= sched.max_queued and decision.reason == QUEUE_FULL
            evicted = sched.evict_lowest(prio) if full else None
            if evicted is None:
                raise self.refusal(
                    "scheduler",
                    prio,
                    f"The gateway's queue is full; {_PRIO_NAMES[prio]}-priority requests are shed."
                    if decision.reason == QUEUE_FULL
                    else f"The gateway is at capacity: {decision.reason} "
                    f"(admission.max_queue_wait_s = {sched.max_wait_s:g} s).",
                    decision.retry_after_s,
                    verdict,
                    request_id,
                )
            assert isinstance(evicted, Waiter)
            if not evicted.fut.done():  # (one whose request just left has its place freed anyway)
                evicted.fut.set_exception(Evicted())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = Waiter(prio, fut)
        sched.enqueue(prio, waiter)
        started = now
        try:
            async with asyncio.timeout(self.cfg.admission.max_queue_wait_s):
                await fut
        except TimeoutError:
            sched.cancel(prio, waiter)
            raise self.refusal(
                "scheduler",
                prio,
                "No capacity freed within "
                f"{self.cfg.admission.max_queue_wait_s:g} s (admission.max_queue_wait_s).",
                sched.retry_after(prio, self.clock()),
                verdict,
                request_id,
            ) from None
        except ShuttingDown:
            raise shutting_down() from None
        except Evicted:
            raise self.refusal(
                "scheduler",
                prio,
                "The gateway's queue is full; this "
                f"{_PRIO_NAMES[prio]}-priority request gave its place to a more urgent one.",
                sched.retry_after(prio, self.clock()),
                verdict,
                request_id,
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(Ticket(prio))  # the slot reached us as we were cancelled
            else:
                sched.cancel(prio, waiter)
            raise
        granted = self.clock()
        self.metrics.queue_wait.labels(_PRIO_NAMES[prio]).observe(granted - started)
        return Ticket(prio, granted)

    def shed_queued(self) -> int:
        """Shutdown: every request waiting in the queue gets 503 ``gateway_shutting_down``
        now (it was never sent, so another instance can take it). Returns how many."""
        waiters = self.scheduler.take_all()
        for w in waiters:
            assert isinstance(w, Waiter)
            if not w.fut.done():
                w.fut.set_exception(ShuttingDown())
        return len(waiters)

    def release(self, ticket: Ticket | None) -> None:
        """The request holding ``ticket`` ended: its slot goes to the next waiter."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        now = self.clock()
        held = None if ticket.started is None else now - ticket.started
        waiter = self.scheduler.release(now, held, prio=ticket.prio)
        if waiter is not None:
            assert isinstance(waiter, Waiter)
            if waiter.fut.done():  # gave up meanwhile: pass the slot on
                self.release(Ticket(waiter.prio))
            else:
                waiter.fut.set_result(None)

    def set_capacity_share(self, slots: int, rate_slots: float | None = None) -> None:
        """Fleet mode: this replica may hold ``slots`` requests in flight (its share of the
        fleet's capacity, ``gateway.coord.capacity``); ``rate_slots``: the steadier share
        its predicted waits use (default ``slots``). With the scheduler's bound on, ``slots``
        becomes the bound (waiters woken when it grows; a lower one cuts nothing) and the
        queue bound becomes ``admission.max_queued`` times ``rate_slots / fleet_capacity``
        (at least 1: N replicas together queue what one gateway would, so the Retry-After a
        refusal carries is one gateway's); with the batcher (which bounds per backend), only
        the capacity its predictions use."""
        sched = self.scheduler
        if sched.max_in_flight is None:
            if sched.capacity is not None:
                sched.capacity = max(1, round(rate_slots if rate_slots is not None else slots))
            return
        steady = rate_slots if rate_slots is not None else slots
        queue = self.cfg.admission.max_queued
        if self.fleet_capacity:  # the queue's share follows the capacity's
            queue = max(1, math.ceil(queue * min(1.0, steady / self.fleet_capacity)))
        self._wake(sched.resize(slots, self.clock(), rate_slots, queue))

    def _wake(self, woken: list[object]) -> None:
        """Waiters the scheduler gave a slot (counted as running in their class)."""
        for w in woken:
            assert isinstance(w, Waiter)
            if w.fut.done():  # gave up meanwhile: its slot goes back
                self.release(Ticket(w.prio))
            else:
                w.fut.set_result(None)

    # ---- degraded mode ----------------------------------------------------------------------
    def tick(self, p99_ttft_s: float | None) -> None:
        """About once a second: update degraded mode from P99 TTFT and the queue."""
        if self.degraded is None:
            return
        overloaded = (p99_ttft_s is not None and p99_ttft_s > self.cfg.slo.ttft_s) or (
            self.scheduler.queued > 0
        )
        level = self.degraded.update(overloaded, self.clock())
        self.metrics.degraded_level.set(level)

    def max_tokens_cap(self) -> int | None:
        """The ``max_tokens`` cap of degraded mode now (None: no cap)."""
        if self.degraded is None:
            return None
        return self.degraded.max_tokens_cap(self.cfg.degraded.max_tokens_cap)


class Evicted(Exception):
    """A queued request lost its place to a more urgent one (admission's queue and the
    batcher's)."""


class ShuttingDown(Exception):
    """The gateway is shutting down: a queued request is answered 503 at once."""
