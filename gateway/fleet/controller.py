"""The fleet's control loops and lifecycle procedures.

Loops: health probes (on a fixed tick, one outstanding per backend), load scrapes, model
discovery, the hung watchdog (:mod:`gateway.fleet.liveness`: every control-plane request
tells a backend's :class:`~gateway.fleet.liveness.Liveness` what it owes and when it was
heard from) and the lifecycle loop that starts maintenance cycles when due. Procedures:
warm-up, drain (with its deadline), the short / medium / long cycles, calibration, the
restart hook, spot preemption.

I/O lives here; every decision comes from the pure rules of
:mod:`gateway.fleet.lifecycle`. Each loop survives its own exceptions (logged, counted in
``gateway_loop_errors_total``) and exports its last success time
(``gateway_loop_last_success_timestamp_seconds{loop}``). The request path reports traffic
outcomes through the backends' circuit breakers (passive outlier detection), and breaker
trips reach :meth:`FleetController.on_breaker_trip`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from gateway.config import ConfigError, GatewayConfig
from gateway.core.vocab import BackendState, Cut
from gateway.fleet import lifecycle, liveness
from gateway.fleet.backend import Backend, Fleet
from gateway.fleet.calibration import Answers, collect_answers, compare
from gateway.fleet.gpu_monitor import GpuMonitor
from gateway.fleet.lifecycle import CycleKind
from gateway.fleet.probes import (
    ENGINE_ENDPOINTS,
    ProbeEndpoints,
    app_probe,
    fetch_models,
    probe_health,
    warm_up,
)
from gateway.fleet.telemetry import scrape_load
from gateway.metrics import GatewayMetrics
from gateway.traffic.breaker import BreakerConfig, CircuitBreaker
from gateway.traffic.capacity import EngineSample

S = BackendState

log = logging.getLogger("gateway.fleet")


class FleetController:
    """Runs the control loops over ``fleet`` and applies lifecycle decisions.

    ``clock`` is monotonic seconds (load samples, rate limits); ``wall`` is unix seconds
    (transition history shown to operators).
    """

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.api_keys = {b.id: b.config.resolved_api_key() for b in fleet}
        bc = cfg.breaker
        breaker_cfg = BreakerConfig(
            consecutive_failures=bc.consecutive_failures,
            error_rate=bc.error_rate,
            min_requests=bc.min_requests,
            window_s=bc.window_s,
            open_base_s=bc.open_base_s,
            open_max_s=bc.open_max_s,
            half_open_max=bc.half_open_max,
            ttft_slo_s=cfg.slo.ttft_s,
            latency_fuse_factor=bc.latency_fuse_factor,
        )
        for b in fleet:
            b.breaker = CircuitBreaker(breaker_cfg, clock)
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._warming: dict[str, asyncio.Task[None]] = {}
        self._maintenance: dict[str, asyncio.Task[None]] = {}
        self._work_client: httpx.AsyncClient | None = None
        self._probing: dict[str, asyncio.Task[None]] = {}  # the outstanding probe of each
        h = cfg.health
        self.liveness_rule = liveness.LivenessRule(h.suspect_after_s, h.hung_after_s)
        self._last_models_refresh = float("-inf")
        self._models_lock = asyncio.Lock()
        self.baselines = _load_baselines(cfg.calibration.baseline_file)
        # per (backend, model): the engine endpoint warm-up, probes and calibration use
        self.probe_endpoints = ProbeEndpoints()
        self.longest_drain_s = 0.0  # seconds, since start (reported by drills)
        self._starting = False
        # requests/s forecast for a model over the next horizon (the arrival forecaster's
        # mean), read before a cycle takes a backend out; None: no forecaster
        self.forecast_rps: Callable[[str], float | None] | None = None
        now = clock()
        for b in fleet:
            b.first_seen = now
        self.gpu = GpuMonitor(self)  # GPU telemetry, thermal cooldowns, Xid/ECC breaker

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "controller not started"
        return self._client

    # ---- start / stop -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the control-plane client, run one probe round, then start the loops.

        The first round is bounded by the probe timeout, so a healthy fleet is routable as
        soon as the gateway accepts traffic and a dead one never blocks start-up.
        """
        h = self.cfg.health
        lc = self.cfg.lifecycle
        # Both clients tell the hung watchdog what came back from each backend; requests of
        # the control client (probes, scrapes, model lists: quick answers) are also owed.
        # A hung backend holds up to ~5 of its connections (a probe, a scrape, model lists)
        # until they time out: room for that, so the others' probes never queue behind it.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(h.timeout_s),
            transport=LivenessTransport(
                self.fleet,
                self.clock,
                owes=True,
                limits=httpx.Limits(max_connections=max(16, 8 * len(self.fleet))),
            ),
        )
        # Warm-up, application probes and calibration generate tokens: a longer timeout.
        self._work_client = httpx.AsyncClient(
            timeout=httpx.Timeout(lc.warmup_timeout_s, connect=h.timeout_s),
            transport=LivenessTransport(
                self.fleet,
                self.clock,
                owes=False,
                limits=httpx.Limits(max_connections=max(16, 16 * len(self.fleet))),
            ),
        )
        now = self.clock()
        for i, b in enumerate(self.fleet):
            b.cycles = lifecycle.initial_cycle_clock(i, len(self.fleet), now, lc)
        self._starting = True
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(h.timeout_s + 1.0, min(lc.warmup_timeout_s, 10.0))):
                    await self.probe_round()
                    if self._warming:
                        await asyncio.gather(*self._warming.values(), return_exceptions=True)
        finally:
            self._starting = False
        t = self.cfg.telemetry
        self._tasks += [
            asyncio.create_task(self._loop("probe", h.interval_s, self.probe_tick)),
            asyncio.create_task(
                self._loop("liveness", liveness.CHECK_INTERVAL_S, self.liveness_round)
            ),
            asyncio.create_task(self._loop("scrape", t.scrape_interval_s, self.scrape_round)),
            asyncio.create_task(self._loop("models", t.models_refresh_s, self.models_round)),
            asyncio.create_task(self._loop("lifecycle", lc.check_interval_s, self.lifecycle_round)),
        ]
        if self.gpu.monitored:
            self.add_loop("gpu_telemetry", self.cfg.thermal.scrape_interval_s, self.gpu.round)

    async def stop(self) -> None:
        tasks = self._tasks + list(self._warming.values()) + list(self._maintenance.values())
        tasks += [b.stall_probe for b in self.fleet if b.stall_probe is not None]
        tasks += list(self._probing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._warming, self._maintenance, self._probing = [], {}, {}, {}
        for client in (self._client, self._work_client):
            if client is not None:
                await client.aclose()
        self._client = self._work_client = None

    def add_loop(
        self, name: str, interval_s: float, body: Callable[[], Awaitable[None]]
    ) -> None:
        """Run ``body`` every ``interval_s`` seconds until :meth:`stop`, as a control loop:
        it survives its own exceptions (logged, counted in ``gateway_loop_errors_total``)
        and exports its last success time. Call it from inside the running event loop."""
        self._tasks.append(asyncio.create_task(self._loop(name, interval_s, body)))

    @property
    def work_client(self) -> httpx.AsyncClient:
        assert self._work_client is not None, "controller not started"
        return self._work_client

    async def _loop(self, name: str, interval: float, body: Callable[[], Awaitable[None]]) -> None:
        gauge = self.metrics.loop_last_success.labels(name)
        errors = self.metrics.loop_errors.labels(name)
        while True:
            try:
                await body()
                gauge.set(self.wall())
            except asyncio.CancelledError:
                raise
            except Exception:
                errors.inc()
                log.exception("control loop %s failed; continuing", name)
            await asyncio.sleep(interval)

    # ---- transitions --------------------------------------------------------------------
    def transition(self, backend: Backend, to: BackendState, reason: str) -> None:
        """Apply one checked transition, log it, count it, and start what it implies
        (warm-up on ``warming``; the slow-start ramp on ``warm``)."""
        if backend.state is to:
            return
        t = lifecycle.apply_transition(backend, to, reason, self.wall())
        level = logging.WARNING if to is S.UNHEALTHY else logging.INFO
        log.log(level, "backend %s: %s -> %s (%s)", backend.id, t.from_state, to, reason)
        self.metrics.transitions.labels(backend.id, t.from_state.value, to.value, reason).inc()
        now = self.clock()
        if to is S.WARM and t.from_state is S.WARMING:
            backend.breaker.reset()  # it came back through probes and warm-up
        if to is S.WARM:
            # A fleet found warm when the gateway starts is not new: no slow start then.
            backend.warm_since = None if self._starting else now
            backend.drained = False
            if backend.first_seen is not None:
                self.metrics.cold_start.observe(now - backend.first_seen)
                backend.first_seen = None
        elif to in (S.COLD, S.UNHEALTHY) and backend.first_seen is None:
            backend.first_seen = now  # the cold-start timer runs until warm again
        if t.from_state is S.DRAINING:
            backend.drain_deadline = None
        if to is S.WARMING:
            self._start_warming(backend)

    def apply(self, backend: Backend, decision: lifecycle.Decision | None) -> None:
        if decision is not None:
            self.transition(backend, decision.to, decision.reason)

    def on_breaker_trip(self, backend: Backend) -> None:
        """The backend's circuit breaker opened (passive outlier detection from real
        traffic). After ``breaker.unhealthy_after_trips`` trips in a row it is
        ``unhealthy`` and must come back through probes and warm-up."""
        br = backend.breaker
        self.metrics.breaker_trips.labels(backend.id, br.last_trip_reason or "").inc()
        log.warning(
            "backend %s: circuit breaker open (%s, trip %d, %.0f s)",
            backend.id,
            br.last_trip_reason,
            br.trips,
            br.retry_in(),
        )
        if br.trips >= self.cfg.breaker.unhealthy_after_trips and backend.state in (
            S.WARM,
            S.WARMING,
            S.DRAINING,
            S.COOLDOWN,
        ):
            self.transition(backend, S.UNHEALTHY, "breaker_open")

    def _start_warming(self, backend: Backend) -> None:
        task = self._warming.get(backend.id)
        if task is not None and not task.done():
            return
        self._warming[backend.id] = asyncio.get_running_loop().create_task(self._warm(backend))

    async def _warm(self, backend: Backend) -> None:
        """Bring a ``warming`` backend to ``warm``: it lists its models, passes the warm-up
        at each batch shape, and (first time only) gives its calibration baseline."""
        await self.refresh_models(backend)
        if backend.state is not S.WARMING or not backend.models:
            return
        lc = self.cfg.lifecycle
        key = self.api_keys[backend.id]
        model = backend.models[0]
        err = await warm_up(
            self.work_client,
            backend,
            model,
            key,
            lc.warmup_batch_shapes,
            lc.warmup_max_tokens,
            self.probe_endpoints,
        )
        if backend.state is not S.WARMING:
            return
        if err is not None:
            backend.note_error(err)
            self.transition(backend, S.UNHEALTHY, "warmup_failed")
            return
        unserved = self.probe_endpoints.unserved_detail(backend.id, model)
        if lc.warmup_batch_shapes and unserved is not None:
            self._unserved(backend, model, "warmup", unserved)  # passes: no verdict
        if backend.needs_calibration:
            # It drifted before: probes passing is not enough, its answers must match again.
            if not await self.calibrate(backend):
                return
            backend.needs_calibration = False
        elif self.cfg.calibration.enabled and backend.calibration_baseline is None:
            baseline = self.baselines.get(model)
            if baseline is None:
                try:
                    got = await self._answers(backend, model)
                except (httpx.HTTPError, ValueError) as e:
                    backend.note_error(f"calibration baseline: {e}")
                else:
                    if got.unserved:
                        self._unserved(backend, model, "calibration", got.detail)
                    else:
                        baseline = got.answers
                        backend.calibration_endpoint = got.endpoint
            backend.calibration_baseline = baseline
        if backend.state is S.WARMING:
            self.transition(backend, S.WARM, "ready")

    # ---- probes ---------------------------------------------------------------------------
    def _config_error(self, backend: Backend, detail: str, status: int | None) -> None:
        self.metrics.backend_config_errors.labels(backend.id, str(status)).inc()
        if backend.config_error != detail:
            log.error(
                "CONFIGURATION ERROR: backend %s rejected the gateway's credentials (%s); "
                "check backends[%s].api_key / api_key_env",
                backend.id,
                detail,
                backend.id,
            )
        backend.config_error = detail

    async def probe_round(self) -> None:
        """Probe every backend once and wait for all the answers (the start-up round)."""
        await asyncio.gather(*(self.probe_one(b) for b in self.fleet))

    async def probe_tick(self) -> None:
        """The probe loop's body: start a probe of every backend whose previous one has
        ended, without waiting for them. The tick is fixed (``health.interval_s``) whatever
        a probe is doing: a backend that does not answer keeps one probe outstanding (its
        silence is the hung watchdog's to judge, :meth:`liveness_round`) and never delays
        the others' probes."""
        loop = asyncio.get_running_loop()
        for b in self.fleet:
            task = self._probing.get(b.id)
            if task is None or task.done():
                self._probing[b.id] = loop.create_task(self._probe_task(b))

    async def _probe_task(self, backend: Backend) -> None:
        try:
            await self.probe_one(backend)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.metrics.loop_errors.labels("probe").inc()
            log.exception("probe of backend %s failed; continuing", backend.id)

    # ---- hung watchdog ----------------------------------------------------------------------
    async def liveness_round(self) -> None:
        """Judge every backend's silence (:mod:`gateway.fleet.liveness`), every
        ``liveness.CHECK_INTERVAL_S`` (0.1 s).

        A serving backend (warm, warming, draining, cooldown) that is *suspected* is
        skipped by the router while another backend can take its requests; one judged
        *hung* goes ``unhealthy`` (``backend_hung``), and its requests still waiting for an
        answer's start (nothing reached their client) are cut so that the pipeline re-sends
        them (:meth:`on_hung`). Streams already started there are left as they are."""
        rule = self.liveness_rule
        now = self.clock()
        backends = self.fleet.backends
        # the latest and second-latest "heard" times: each backend's peers' latest
        first = second = float("-inf")
        first_id = ""
        for b in backends:
            t = b.liveness.heard_at
            if t > first:
                first, second, first_id = t, first, b.id
            elif t > second:
                second = t
        for b in backends:
            peers = second if b.id == first_id else first
            verdict = b.liveness.check(now, peers, rule)
            serving = b.state in (S.WARM, S.WARMING, S.DRAINING, S.COOLDOWN)
            suspected = serving and verdict is not liveness.Verdict.ALIVE
            if suspected != b.suspected:
                b.suspected = suspected
                event = "suspected" if suspected else "cleared"
                self.metrics.liveness_events.labels(b.id, event).inc()
                if suspected:
                    log.warning(
                        "backend %s: suspected hung: owes %d control answer(s) and nothing "
                        "came back for %.1f s; new requests go elsewhere",
                        b.id,
                        b.liveness.owed,
                        b.liveness.silence_s,
                    )
                else:
                    log.info("backend %s: no longer suspected (answering)", b.id)
            if serving and verdict is liveness.Verdict.HUNG:
                self.on_hung(b)

    def on_hung(self, backend: Backend) -> None:
        """``backend`` is hung: ``unhealthy`` (reason ``backend_hung``, counted in
        ``gateway_backend_liveness_events_total{event="hung"}`` and the transitions), and
        each request waiting on it for an answer's start is cut (``Cut.BACKEND_HUNG``) when
        another backend can take its model, so the pipeline re-sends it there; one that
        no other backend can take keeps waiting (the backend may come back). Probes bring
        it back as from any ``unhealthy``."""
        lv = backend.liveness
        now = self.clock()
        waiting = list(backend.awaiting.items())
        movable = [h for h, model in waiting if self._other_can_take(backend, model, now)]
        self.metrics.liveness_events.labels(backend.id, "hung").inc()
        peers = "another backend answered meanwhile" if lv.peer_heard else "no other did"
        detail = (
            f"hung: owed {lv.owed} control answer(s) and nothing came back for "
            f"{lv.silence_s:.1f} s ({peers})"
        )
        backend.note_error(detail)
        log.warning(
            "backend %s: %s; re-sending %d of %d request(s) waiting for a first byte",
            backend.id,
            detail,
            len(movable),
            len(waiting),
        )
        self.transition(backend, S.UNHEALTHY, "backend_hung")
        backend.suspected = False
        for handle in movable:
            handle.cut(Cut.BACKEND_HUNG)

    def _other_can_take(self, backend: Backend, model: str, now: float) -> bool:
        """Whether a backend other than ``backend`` may take a request for ``model`` now
        (warm, serving it, not suspected, not cooling, breaker letting requests through)."""
        return any(
            o is not backend
            and o.state is S.WARM
            and model in o.models
            and not o.suspected
            and o.cooling_until <= now
            and o.breaker.can_take()
            for o in self.fleet
        )

    async def probe_one(self, backend: Backend) -> None:
        res = await probe_health(self.client, backend, self.api_keys[backend.id])
        self.metrics.probe_results.labels(backend.id, res.status).inc()
        if res.status == "auth":
            # Alive, but refusing our key: a gateway misconfiguration, never "dead".
            self._config_error(backend, res.detail, res.http_status)
            ok = True
        else:
            ok = res.status == "ok"
            if not ok:
                backend.note_error(res.detail)
        if backend.hold in ("preempted", "restarting") and (
            not ok or (backend.hold_until is not None and self.clock() >= backend.hold_until)
        ):
            log.info(
                "backend %s: %s hold over (%s)",
                backend.id,
                backend.hold,
                "it went away" if not ok else "hold time passed",
            )
            backend.hold = backend.hold_until = None
        self.apply(backend, lifecycle.after_probe(backend, ok, self.cfg.health))
        if ok and backend.state is S.WARMING:
            self._start_warming(backend)

    # ---- load scrapes ---------------------------------------------------------------------
    async def scrape_round(self) -> None:
        await asyncio.gather(
            *(
                self.scrape_one(b)
                for b in self.fleet
                if b.state is not BackendState.COLD or b.hold == "restarting"
            )
        )

    async def scrape_one(self, backend: Backend) -> None:
        try:
            backend.load = await scrape_load(
                self.client,
                backend,
                self.api_keys[backend.id],
                self.clock,
                self.cfg.telemetry.scrape_timeout_s,
            )
            backend.last_scrape_ok_at = self.clock()
            load = backend.load
            backend.service.observe(
                EngineSample(
                    load.scraped_at,
                    load.waiting,
                    load.running,
                    load.finished_total,
                )
            )
            started = backend.load.process_start_s
            if (
                backend.hold == "restarting"
                and started is not None
                and backend.restart_seen_after is not None
                and started != backend.restart_seen_after
            ):
                log.info("backend %s: restart seen (a new server process); hold over", backend.id)
                backend.hold = backend.hold_until = backend.restart_seen_after = None
        except (httpx.HTTPError, ValueError) as e:
            self.metrics.scrape_errors.labels(backend.id).inc()
            backend.note_error(f"scrape: {type(e).__name__}: {e}".rstrip(": "))

    # ---- model discovery ------------------------------------------------------------------
    async def models_round(self) -> None:
        self._last_models_refresh = self.clock()
        await asyncio.gather(
            *(self.refresh_models(b) for b in self.fleet if b.state is not BackendState.COLD)
        )

    async def refresh_models(self, backend: Backend) -> None:
        """Learn what ``backend`` serves from its ``/v1/models`` (unless set in config)."""
        res = await fetch_models(self.client, backend, self.api_keys[backend.id])
        if res.status == "auth":
            self._config_error(backend, res.detail, res.http_status)
            return
        if res.cards is None:
            backend.note_error(res.detail)
            return
        if backend.config_error and res.status == "ok":
            backend.config_error = None
        backend.model_cards = res.cards
        if backend.config.models is None:
            backend.models = tuple(c.id for c in res.cards)

    async def refresh_models_soon(self, min_interval_s: float = 1.0) -> None:
        """Refresh every backend's model list now, at most once per ``min_interval_s``.

        Used when a request names a model nobody lists (a LoRA adapter just loaded).
        """
        async with self._models_lock:
            if self.clock() - self._last_models_refresh < min_interval_s:
                return
            await self.models_round()

    # ---- lifecycle loop and maintenance cycles ---------------------------------------------
    def busy(self, backend: Backend) -> bool:
        """Whether a maintenance procedure (cycle, drain) is running on ``backend``."""
        task = self._maintenance.get(backend.id)
        return task is not None and not task.done()

    def _run(self, backend: Backend, name: str, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run one maintenance procedure on ``backend`` (at most one at a time)."""

        async def wrapped() -> None:
            backend.maintenance = name
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.loop_errors.labels(f"maintenance_{name}").inc()
                log.exception("backend %s: %s failed", backend.id, name)
            finally:
                backend.maintenance = None

        task = asyncio.get_running_loop().create_task(wrapped())
        self._maintenance[backend.id] = task
        return task

    async def lifecycle_round(self) -> None:
        """Start every cycle that is due and allowed (staggered per model).

        The most overdue backends go first, and a backend leaves rotation (``draining``)
        here, synchronously, so the next backend's stagger check already counts it out.
        """
        lc = self.cfg.lifecycle
        stall = self.cfg.health.stall_after_s
        for b in self.fleet:
            if b.state is S.WARM and b.breaker.evaluate():
                self.on_breaker_trip(b)  # latency fuse: P99 TTFT over 5x the SLO
            if (
                b.state is S.WARM
                and b.in_flight > 0
                and self.clock() - max(b.last_answer_at, b.busy_since) > stall
                and (b.stall_probe is None or b.stall_probe.done())
            ):
                b.stall_probe = asyncio.get_running_loop().create_task(self.stall_probe(b))
        now = self.clock()
        for b in self.fleet:
            if b.deferred is not None and b.state is not S.WARM:
                b.deferred = None  # it left rotation another way: nothing held back now
                self.metrics.cycle_deferred.labels(b.id).set(0)
        due = [
            b for b in self.fleet if b.cycles is not None and not self.busy(b) and b.state is S.WARM
        ]
        due.sort(key=lambda b: min(b.cycles.next_long, b.cycles.next_medium, b.cycles.next_short))
        for b in due:
            kind = lifecycle.due_cycle(b.cycles, now, b.requests_served, lc)
            if kind is None:
                continue
            if kind is not CycleKind.SHORT:
                if not lifecycle.may_take_out(b, self.fleet.backends, lc):
                    continue  # staggered: it stays due and starts when allowed
                why = lifecycle.can_carry_without(
                    b, self.fleet.backends, self.demand(), lc.carry_utilization,
                    now, self.cfg.telemetry.stale_after_s,
                )
                if why is not None:
                    self._defer(b, kind, why, now)
                    if now >= b.cycles.next_short:  # the engine probe is not held back
                        lifecycle.cycle_started(
                            b.cycles, CycleKind.SHORT, now, b.requests_served, lc
                        )
                        self.metrics.cycles.labels(b.id, CycleKind.SHORT.value).inc()
                        self._run(b, "short", self.short_cycle(b))
                    continue  # deferred: it stays due and starts at the next quiet moment
            self._end_deferral(b, now)
            lifecycle.cycle_started(b.cycles, kind, now, b.requests_served, lc)
            self.metrics.cycles.labels(b.id, kind.value).inc()
            if kind is CycleKind.SHORT:
                self._run(b, "short", self.short_cycle(b))
            elif kind is CycleKind.MEDIUM:
                self.transition(b, S.DRAINING, "cooldown_scheduled")
                self._run(
                    b,
                    "medium",
                    self.medium_cycle(b, "scheduled", rest_done=self.gpu.scheduled_rest_done(b)),
                )
            else:
                self.transition(b, S.DRAINING, "restart_scheduled")
                self._run(b, "long", self.long_cycle(b, "scheduled"))

    def demand(self) -> dict[str, float]:
        """Requests per second each model must be served at now and over the forecast
        horizon: the larger of the completion rate its backends report (summed) and the
        arrival forecast's mean (:attr:`forecast_rps`, when there is one)."""
        out: dict[str, float] = {}
        for b in self.fleet:
            serving = b.state in lifecycle.SERVING
            for m in b.models:  # a backend out of service (dead) adds no demand
                out[m] = out.get(m, 0.0) + (b.service.completion_rate if serving else 0.0)
        if self.forecast_rps is not None:
            for m in out:
                f = self.forecast_rps(m)
                if f is not None and f > out[m]:
                    out[m] = f
        return out

    def _defer(self, b: Backend, kind: CycleKind, why: str, now: float) -> None:
        """Hold a due cycle back (the others cannot carry the load); after
        ``lifecycle.max_defer_s`` it is skipped until its next period."""
        lc = self.cfg.lifecycle
        if b.deferred is None or b.deferred[0] != kind.value:
            b.deferred = (kind.value, now, why)
            self.metrics.cycle_deferrals.labels(b.id, kind.value, "deferred").inc()
            self.metrics.cycle_deferred.labels(b.id).set(1)
            log.info("backend %s: %s cycle deferred: %s", b.id, kind.value, why)
            return
        since = b.deferred[1]
        b.deferred = (kind.value, since, why)
        if now - since >= lc.max_defer_s:
            log.warning(
                "backend %s: %s cycle skipped after %.0f s deferred (%s); next one in a period",
                b.id, kind.value, now - since, why,
            )
            self.metrics.cycle_deferrals.labels(b.id, kind.value, "skipped").inc()
            lifecycle.cycle_started(b.cycles, kind, now, b.requests_served, lc)
            b.deferred = None
            self.metrics.cycle_deferred.labels(b.id).set(0)

    def _end_deferral(self, b: Backend, now: float) -> None:
        if b.deferred is not None:
            log.info(
                "backend %s: %s cycle starts after %.0f s deferred",
                b.id, b.deferred[0], now - b.deferred[1],
            )
            self.metrics.cycle_deferral_seconds.observe(now - b.deferred[1])
            b.deferred = None
            self.metrics.cycle_deferred.labels(b.id).set(0)

    async def stall_probe(self, backend: Backend) -> None:
        """Requests are in flight but nothing came back for ``health.stall_after_s``: ask for
        one token now. A backend whose ``/health`` still passes while its engine is stuck
        fails here: it goes ``unhealthy`` (``engine_stalled``) and its requests are ended
        (those still waiting for a first byte are re-sent elsewhere; streams get an error
        event)."""
        if not backend.models:
            return
        h = self.cfg.health
        res = await app_probe(
            self.work_client,
            backend,
            backend.models[0],
            self.api_keys[backend.id],
            timeout_s=h.stall_probe_timeout_s,
            endpoints=self.probe_endpoints,
        )
        if res.unserved:  # it answered (a 4xx on every endpoint): alive, no verdict
            self._unserved(backend, backend.models[0], "app_probe", res.detail)
        if res.ok:
            backend.last_answer_at = self.clock()  # alive: look again after another stall
            return
        backend.note_error(f"engine stalled: {res.detail}")
        log.warning(
            "backend %s: in-flight requests got nothing for %.0f s and a 1-token probe failed (%s)",
            backend.id,
            h.stall_after_s,
            res.detail,
        )
        if backend.state is S.WARM:
            self.transition(backend, S.UNHEALTHY, "engine_stalled")
        for handle in list(backend.active):
            handle.cut(Cut.BACKEND_HUNG)

    async def short_cycle(self, backend: Backend) -> None:
        """Probe through the engine; no traffic change unless it fails."""
        if not backend.models:
            return
        res = await app_probe(
            self.work_client,
            backend,
            backend.models[0],
            self.api_keys[backend.id],
            self.cfg.lifecycle.app_probe_max_tokens,
            endpoints=self.probe_endpoints,
        )
        if res.unserved:  # it answered (a 4xx on every endpoint): alive, no verdict
            self._unserved(backend, backend.models[0], "app_probe", res.detail)
            return
        if res.ok:
            backend.probe_ttft_s = res.ttft_s
            if res.ttft_s is not None:
                self.metrics.probe_ttft.labels(backend.id).set(res.ttft_s)
            return
        backend.note_error(res.detail)
        if backend.state is S.WARM:
            self.transition(backend, S.UNHEALTHY, "app_probe_failed")

    async def drain(self, backend: Backend, deadline_s: float, reason: str) -> bool:
        """Stop new requests to ``backend`` at once and wait for its in-flight ones.

        At the deadline (seconds from now) the remaining requests are cut: streams end
        with an error event then ``[DONE]``; a request still waiting for its answer is
        re-sent to another backend. Returns True when the backend is still ``draining``
        with nothing in flight (False: something else changed its state meanwhile).
        """
        if backend.state in (S.WARM, S.WARMING):
            self.transition(backend, S.DRAINING, reason)
        if backend.state is not S.DRAINING:
            return False
        started = self.clock()
        if backend.drain_deadline is None:
            backend.drain_deadline = started + deadline_s
        cut = False
        while backend.in_flight > 0 and backend.state is S.DRAINING:
            deadline = backend.drain_deadline  # an admin may move it meanwhile
            if not cut and deadline is not None and self.clock() >= deadline:
                cut = True
                log.warning(
                    "backend %s: drain deadline passed after %.1f s with %d in flight; ending them",
                    backend.id,
                    self.clock() - started,
                    backend.in_flight,
                )
                for handle in list(backend.active):
                    handle.cut(Cut.DRAIN_DEADLINE)
            await asyncio.sleep(0.05)
        took = self.clock() - started
        self.metrics.drain_seconds.observe(took)
        self.longest_drain_s = max(self.longest_drain_s, took)
        return backend.state is S.DRAINING

    async def manual_drain(self, backend: Backend, deadline_s: float, preempt: bool) -> None:
        """Admin drain (held out of rotation until undrained) or spot preemption (then
        ``cold``, held until the instance goes away or ``lifecycle.preempt_hold_s``)."""
        reason = "spot_preemption" if preempt else "admin_drain"
        if not await self.drain(backend, deadline_s, reason):
            return
        if backend.hold == "preempted":
            self.transition(backend, S.COLD, "spot_preemption")
        else:
            backend.drained = True
            log.info("backend %s: drained (nothing in flight)", backend.id)

    def undrain(self, backend: Backend) -> bool:
        """Return a drained, draining or resting backend to rotation (with slow start); a
        held backend that is down (cold, unhealthy) returns when its probes pass."""
        held = backend.hold is not None
        backend.hold = backend.hold_until = None
        if backend.state in (S.DRAINING, S.COOLDOWN):
            task = self._maintenance.get(backend.id)
            if task is not None and not task.done():
                task.cancel()
            self.transition(backend, S.WARM, "admin_undrain")
            return True
        return held

    async def medium_cycle(
        self,
        backend: Backend,
        reason: str,
        min_rest_s: float = 0.0,
        rest_done: Callable[[float], bool] | None = None,
    ) -> None:
        """Drain -> reset prefix cache -> rest (probes only; optional vLLM sleep) ->
        calibration -> slow-start return.

        The rest lasts ``max(medium.cooldown_s, min_rest_s)`` seconds, or, with
        ``rest_done`` (called with the seconds rested so far), until it returns True: a
        thermal cooldown rests until the GPU is cool (:mod:`gateway.fleet.gpu_monitor`)."""
        lc = self.cfg.lifecycle
        if not await self.drain(backend, lc.drain_deadline_s, f"cooldown_{reason}"):
            return
        self.transition(backend, S.COOLDOWN, "drained")
        await self._reset_prefix_cache(backend)
        rest = max(lc.medium.cooldown_s, min_rest_s)
        slept = lc.medium.sleep and await self._vllm_post(backend, "/sleep?level=1")
        start = self.clock()
        deadline = start + rest

        def resting() -> bool:
            now = self.clock()
            return now < deadline if rest_done is None else not rest_done(now - start)

        while resting():
            if backend.state is not S.COOLDOWN:
                return  # a probe failed meanwhile, or an admin undrained it
            wait = 0.25 if rest_done is not None else min(0.25, max(0.0, deadline - self.clock()))
            await asyncio.sleep(wait)
        if slept:
            await self._vllm_post(backend, "/wake_up")
        if backend.state is not S.COOLDOWN:
            return
        if not await self.calibrate(backend):
            return
        if backend.hold is not None:
            backend.drained = True  # an admin drained it meanwhile: it stays out
            return
        if backend.state is S.COOLDOWN:
            self.transition(backend, S.WARM, "cooldown_done")

    async def long_cycle(self, backend: Backend, reason: str) -> None:
        """Drain -> restart hook -> ``cold`` (probes then bring it through warming)."""
        if not await self.drain(backend, self.cfg.lifecycle.drain_deadline_s, f"restart_{reason}"):
            return
        before = backend.load.process_start_s if backend.load is not None else None
        if await self.run_restart_hook(backend):
            # Hold it out until the restart is seen (a failed probe, or a scrape showing a
            # new server process) or the hold passes, so the old process does not take
            # traffic in the moment before it goes away.
            backend.hold = "restarting"
            backend.hold_until = self.clock() + self.cfg.lifecycle.restart_hold_s
            backend.restart_seen_after = before
        if backend.state is S.DRAINING:
            self.transition(backend, S.COLD, "restarted")

    def request_cooldown(
        self,
        backend_id: str,
        reason: str,
        min_rest_s: float = 0.0,
        force: bool = False,
        rest_done: Callable[[float], bool] | None = None,
    ) -> bool:
        """Run the medium cycle on a backend now: the entry point for the admin API and for
        thermal triggers. Respects staggering (``max_unavailable``, never the last warm
        backend of a model) unless ``force``. ``rest_done`` replaces the fixed rest (see
        :meth:`medium_cycle`). Returns whether the cycle started."""
        backend = self.fleet.get(backend_id)
        if backend is None or self.busy(backend) or backend.state is not S.WARM:
            return False
        if not force and not lifecycle.may_take_out(
            backend, self.fleet.backends, self.cfg.lifecycle
        ):
            return False
        if backend.cycles is not None:
            lifecycle.cycle_started(
                backend.cycles,
                CycleKind.MEDIUM,
                self.clock(),
                backend.requests_served,
                self.cfg.lifecycle,
            )
        self.metrics.cycles.labels(backend.id, "medium").inc()
        self.transition(backend, S.DRAINING, f"cooldown_{reason}")  # out now: stagger counts it
        self._run(backend, "medium", self.medium_cycle(backend, reason, min_rest_s, rest_done))
        return True

    def start_drain(self, backend: Backend, deadline_s: float, preempt: bool = False) -> bool:
        """Admin drain or spot preemption of ``backend``, whatever it is doing.

        The backend is held out of rotation (``hold``): an admin drain until undrain, a
        preemption until the instance goes away (or ``lifecycle.preempt_hold_s``). A warm or
        warming backend starts draining now (``deadline_s`` from now); one already draining
        keeps its procedure and gets the earlier of the two deadlines; one resting or down
        just stays out when its cycle or probes would have brought it back. Returns False
        when nothing changed (already held the same way).
        """
        now = self.clock()
        want = "preempted" if preempt else "admin_drain"
        if backend.hold == want and (
            backend.state is not S.DRAINING or backend.drained or backend.hold == "preempted"
        ):
            return False  # already drained / preempted
        if backend.hold != "preempted":  # a preemption is never downgraded to a drain
            backend.hold = want
            backend.hold_until = now + self.cfg.lifecycle.preempt_hold_s if preempt else None
        if backend.state in (S.WARM, S.WARMING):
            task = self._maintenance.get(backend.id)
            if task is not None and not task.done():
                task.cancel()  # e.g. a short cycle's probe
            self.transition(backend, S.DRAINING, "spot_preemption" if preempt else "admin_drain")
            backend.drain_deadline = now + deadline_s
            self._run(
                backend,
                "preempt" if preempt else "drain",
                self.manual_drain(backend, deadline_s, preempt),
            )
        elif backend.state is S.DRAINING:
            if backend.drain_deadline is None or now + deadline_s < backend.drain_deadline:
                backend.drain_deadline = now + deadline_s
            if not self.busy(backend):
                self._run(backend, "drain", self.manual_drain(backend, deadline_s, preempt))
        return True

    # ---- calibration and hooks ---------------------------------------------------------------
    async def _answers(self, backend: Backend, model: str, only: str | None = None) -> Answers:
        """The calibration prompts' answers from ``backend`` for ``model``, on the engine
        endpoint it serves (``only``: that endpoint alone). Raises ``httpx.HTTPError`` and
        ``ValueError`` (see :func:`gateway.fleet.calibration.collect_answers`)."""
        c = self.cfg.calibration
        return await collect_answers(
            self.work_client,
            backend,
            model,
            c.prompts,
            c.max_tokens,
            c.seed,
            self.api_keys[backend.id],
            self.probe_endpoints,
            only,
        )

    def _unserved(self, backend: Backend, model: str, check: str, detail: str) -> None:
        """``check`` (warmup / app_probe / calibration) found ``backend`` answering but
        serving none of the engine endpoints for ``model``: not a health verdict, the check
        passes. Counted in ``gateway_probe_unserved_total``; noted in the backend's last
        error and logged once (until an endpoint answers again)."""
        self.metrics.probe_unserved.labels(backend.id, check).inc()
        if self.probe_endpoints.report(backend.id, model) is None:
            return
        message = (
            f"{check}: serves none of {', '.join(ENGINE_ENDPOINTS)} for model {model} "
            f"({detail}); warm-up and probes pass without a verdict, calibration is skipped"
        )
        backend.note_error(message)
        log.warning("backend %s: %s", backend.id, message)

    async def calibrate(self, backend: Backend) -> bool:
        """Compare the backend's answers with its baseline; False (and ``unhealthy``,
        reason ``calibration_drift``, plus the restart hook) below the threshold."""
        c = self.cfg.calibration
        if not c.enabled or not backend.models:
            return True
        model = backend.models[0]
        own = backend.calibration_baseline
        baseline = own or self.baselines.get(model)
        only = backend.calibration_endpoint if own else None  # compared on its endpoint
        try:
            got = await self._answers(backend, model, only)
            if got.unserved and only is not None:
                # the baseline's endpoint is no longer served: no comparison is possible; a
                # new baseline on the endpoint served now
                log.warning(
                    "backend %s: calibration baseline endpoint %s is no longer served (%s); "
                    "taking a new baseline",
                    backend.id,
                    only,
                    got.detail,
                )
                backend.calibration_baseline = backend.calibration_endpoint = None
                baseline = self.baselines.get(model)
                got = await self._answers(backend, model)
        except (httpx.HTTPError, ValueError) as e:
            backend.note_error(f"calibration: {e}")
            if backend.state is S.COOLDOWN:
                self.transition(backend, S.UNHEALTHY, "calibration_failed")
            return False
        if got.unserved:  # skipped: no drift verdict without answers
            self._unserved(backend, model, "calibration", got.detail)
            return True
        answers = got.answers
        if baseline is None:
            backend.calibration_baseline = answers
            backend.calibration_endpoint = got.endpoint
            return True
        result = compare(baseline, answers)
        backend.calibration_score = result.similarity
        self.metrics.calibration_score.labels(backend.id).set(result.similarity)
        log.info(
            "backend %s: calibration exact-match %.2f similarity %.3f",
            backend.id,
            result.exact_match,
            result.similarity,
        )
        if result.similarity >= c.threshold:
            backend.needs_calibration = False
            return True
        backend.note_error(
            f"calibration drift: similarity {result.similarity:.3f} < {c.threshold} "
            f"(exact match {result.exact_match:.2f})"
        )
        backend.needs_calibration = True
        if backend.state in (S.COOLDOWN, S.WARM, S.WARMING, S.DRAINING):
            self.transition(backend, S.UNHEALTHY, "calibration_drift")
        await self.run_restart_hook(backend)
        return False

    async def run_restart_hook(self, backend: Backend) -> bool:
        """Run the configured restart hook for ``backend`` (none: only logged). True when
        a hook ran successfully."""
        hook = self.cfg.lifecycle.restart_hook
        if hook is None:
            log.info("backend %s: no restart hook configured; a restart would go here", backend.id)
            self.metrics.restart_hooks.labels(backend.id, "none").inc()
            return False
        subst = {"backend_id": backend.id, "url": backend.base_url}
        try:
            if hook.command is not None:
                argv = [a.format(**subst) for a in hook.command]
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
                try:
                    async with asyncio.timeout(hook.timeout_s):
                        _, err = await proc.communicate()
                except BaseException:  # timeout, or the gateway stopping: never leave it behind
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(proc.wait(), 5)
                    raise
                ok = proc.returncode == 0
                detail = f"exit {proc.returncode}: {err.decode(errors='replace')[-200:]}"
            else:
                assert hook.url is not None
                r = await self.work_client.request(
                    hook.method, hook.url.format(**subst), timeout=hook.timeout_s
                )
                ok = r.status_code < 400
                detail = f"HTTP {r.status_code}"
        except (OSError, TimeoutError, httpx.HTTPError) as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        self.metrics.restart_hooks.labels(backend.id, "ok" if ok else "failed").inc()
        if ok:
            log.info("backend %s: restart hook ran (%s)", backend.id, detail)
        else:
            log.error("backend %s: restart hook failed (%s)", backend.id, detail)
            backend.note_error(f"restart hook failed: {detail}")
        return ok

    async def _vllm_post(self, backend: Backend, path: str) -> bool:
        """POST a vLLM dev-mode route; False when absent (404) or failing."""
        headers = {"authorization": f"Bearer {k}"} if (k := self.api_keys[backend.id]) else None
        try:
            r = await self.work_client.post(f"{backend.base_url}{path}", headers=headers)
        except httpx.HTTPError as e:
            backend.note_error(f"{path}: {type(e).__name__}")
            return False
        if r.status_code == 404:
            log.info(
                "backend %s: %s not supported (404; vLLM needs VLLM_SERVER_DEV_MODE=1)",
                backend.id,
                path,
            )
            return False
        return r.status_code < 300

    async def _reset_prefix_cache(self, backend: Backend) -> None:
        """``POST /reset_prefix_cache``; vLLM refuses (``success: false``) while blocks are
        in use, so retry a few times."""
        for _ in range(5):
            headers = {"authorization": f"Bearer {k}"} if (k := self.api_keys[backend.id]) else None
            try:
                r = await self.work_client.post(
                    f"{backend.base_url}/reset_prefix_cache", headers=headers
                )
            except httpx.HTTPError:
                return
            if r.status_code == 404:
                log.info("backend %s: /reset_prefix_cache not supported (404)", backend.id)
                return
            try:
                if r.status_code == 200 and r.json().get("success", True) is not False:
                    self.metrics.prefix_cache_resets.labels(backend.id).inc()
                    return
            except ValueError:
                return
            await asyncio.sleep(0.5)


def _load_baselines(path: str | None) -> dict[str, dict[str, object]]:
    """Calibration baselines from a JSON file ``{model: {prompt: answer}}`` (or none)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"calibration.baseline_file {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"calibration.baseline_file {path}: expected {{model: {{prompt: answer}}}}"
        )
    return data


class LivenessTransport(httpx.AsyncBaseTransport):
    """An httpx transport that reports each request to a backend of ``fleet`` to that
    backend's :class:`~gateway.fleet.liveness.Liveness`: an answer (response headers, any
    status) is *heard*; with ``owes`` (the control-plane client) the request is also owed
    until then, and a timeout leaves it owed (``unanswered``), while a refused or reset
    connection, a wait for a pooled connection or a cancellation owe nothing (``dropped``).
    Requests to other URLs (a restart hook) pass through untouched. ``clock``: monotonic
    seconds. Errors are re-raised unchanged."""

    def __init__(
        self,
        fleet: Fleet,
        clock: Callable[[], float],
        owes: bool,
        limits: httpx.Limits,
    ) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=limits)
        self._clock = clock
        self._owes = owes
        # longest base URL first, so a backend under a path prefix wins over its host
        self._bases = sorted(
            ((b.base_url.rstrip("/"), b) for b in fleet), key=lambda x: len(x[0]), reverse=True
        )

    def backend_of(self, url: str) -> Backend | None:
        """The backend whose base URL ``url`` is under, or None."""
        for base, b in self._bases:
            if url.startswith(base) and (len(url) == len(base) or url[len(base)] in "/?#"):
                return b
        return None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        backend = self.backend_of(str(request.url))
        if backend is None:
            return await self._inner.handle_async_request(request)
        lv = backend.liveness
        token = lv.sent(self._clock()) if self._owes else None
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.PoolTimeout:
            if token is not None:
                lv.dropped(token)
            raise
        except httpx.TimeoutException:
            if token is not None:
                lv.unanswered(token)
            raise
        except BaseException:
            if token is not None:
                lv.dropped(token)
            raise
        if token is not None:
            lv.answered(token, self._clock())
        else:
            lv.heard(self._clock())
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
