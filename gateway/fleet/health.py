"""Health: active probes on a fixed tick, the hung watchdog's rounds, and what a hung
backend means for the requests waiting on it.

Every ``health.interval_s`` (:meth:`HealthChecks.probe_tick`) a ``GET /health`` is sent to
each backend whose previous probe has ended (a backend that does not answer keeps one
probe outstanding and never delays the others'); the pure rule
:func:`gateway.fleet.lifecycle.after_probe` turns the results into transitions. Every
``liveness.CHECK_INTERVAL_S`` (:meth:`HealthChecks.liveness_round`) each backend's silence
is judged (:mod:`gateway.fleet.liveness`, fed by
:class:`gateway.fleet.clients.LivenessTransport`): a suspected one is routed around, a hung
one goes ``unhealthy`` and its requests still waiting for an answer's start are cut to be
re-sent elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config import HealthConfig
from gateway.core.vocab import BackendState, Cut
from gateway.fleet import lifecycle, liveness
from gateway.fleet.backend import Backend
from gateway.fleet.clients import ControlClients
from gateway.fleet.fleet import Fleet
from gateway.fleet.probes import probe_health
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")


class HealthChecks:
    """Probes and the hung watchdog over ``fleet``. ``warm``: starts the warm-up of a
    backend that is ``warming`` (none running); ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: HealthConfig,
        fleet: Fleet,
        state: FleetState,
        clients: ControlClients,
        metrics: GatewayMetrics,
        warm: Callable[[Backend], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.state = state
        self.clients = clients
        self.metrics = metrics
        self.warm = warm
        self.clock = clock
        self.rule = liveness.LivenessRule(cfg.suspect_after_s, cfg.hung_after_s)
        self._probing: dict[str, asyncio.Task[None]] = {}  # the outstanding probe of each

    async def stop(self) -> None:
        """Cancel the outstanding probes and wait for them to end."""
        tasks, self._probing = list(self._probing.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def forget(self, backend: Backend) -> None:
        """``backend`` left the fleet: cancel its outstanding probe (if running) and drop it."""
        task = self._probing.pop(backend.id, None)
        if task is not None:
            task.cancel()

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
        rule = self.rule
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
            if b.set_suspected(suspected):
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
        self.state.transition(backend, S.UNHEALTHY, "backend_hung")
        backend.set_suspected(False)
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
        """Probe ``backend``'s ``/health`` once and apply the health rule
        (:func:`gateway.fleet.lifecycle.after_probe`). A 401/403 is a configuration error
        and counts as passing; a failed probe ends a ``preempted`` / ``restarting`` hold (the
        instance went away), as does a passing one after the hold's time."""
        res = await probe_health(self.clients.control, backend, backend.api_key)
        self.metrics.probe_results.labels(backend.id, res.status).inc()
        if res.status == "auth":
            # Alive, but refusing our key: a gateway misconfiguration, never "dead".
            self.state.auth_refused(backend, res.detail, res.http_status)
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
            self.state.release_hold(backend)
        self.state.apply(backend, lifecycle.after_probe(backend, ok, self.cfg))
        if ok and backend.state is S.WARMING:
            self.warm(backend)
