"""The fleet-state service: the one writer of the backends' control-plane records.

:class:`FleetState` owns every change of a backend's :class:`~gateway.fleet.backend.
ControlRecord`: state transitions (checked against the lifecycle's legal moves, logged,
counted, with what each implies: the slow-start ramp on ``warm``, the cold-start timer,
the breaker reset after a recovery), holds out of rotation, drain deadlines and the
``drained`` mark, maintenance markers, deferrals of due cycles and configuration errors
(the backend refused the gateway's key). The control loops (:mod:`gateway.fleet.health`,
:mod:`~gateway.fleet.maintenance`, ...) call it; the request path reports what it saw with
:meth:`FleetState.auth_refused` and :meth:`FleetState.breaker_tripped` and otherwise only
reads :class:`~gateway.fleet.backend.Backend` attributes and calls the backend's own
request-path methods.

**The storage seam.** FleetState computes each new record and hands it, with the
transition it carries, to its :class:`ControlStore`; the store decides where the record
lives and applies it to the local :class:`~gateway.fleet.backend.Backend` with
:meth:`~gateway.fleet.backend.Backend.apply_control`. :class:`LocalStore` (one gateway)
applies it at once. A shared store (several gateway replicas, e.g. over Redis) would
write the record there (compare-and-set on the backend's key) and apply the records
other replicas commit to the same local Backend objects as they arrive: the request path,
which reads only those attributes, does not change. What stays per replica: the request
path's own counts (in flight, cooling, served), the liveness watchdog's observations and
the probe counters, the breaker, the load samples and service model (each replica
measures its own traffic and scrapes).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

from gateway.core.vocab import BackendState
from gateway.fleet import lifecycle
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.fleet.records import ControlRecord, Deferral, Transition
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")

# Called after each transition: the backend (already in its new state) and the change.
TransitionListener = Callable[[Backend, Transition], None]


class ControlStore(Protocol):
    """Where the backends' control-plane records live (module docstring: the seam)."""

    def commit(self, backend: Backend, record: ControlRecord, moved: Transition | None) -> None:
        """Make ``record`` ``backend``'s control-plane record (``moved``: the state change
        it carries, or None) and apply it to ``backend``."""


class LocalStore:
    """The records of one gateway: the Backend objects themselves."""

    def commit(self, backend: Backend, record: ControlRecord, moved: Transition | None) -> None:
        """Apply ``record`` to ``backend`` now."""
        backend.apply_control(record, moved)


class FleetState:
    """The control-plane state of ``fleet``'s backends and every change to it.

    ``clock``: monotonic seconds (timers, deadlines); ``wall``: unix seconds (the
    transition history shown to operators). ``unhealthy_after_trips``: breaker trips in a
    row that make a serving backend ``unhealthy``. ``store``: where the records live
    (default :class:`LocalStore`).
    """

    def __init__(
        self,
        fleet: Fleet,
        metrics: GatewayMetrics,
        unhealthy_after_trips: int,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        store: ControlStore | None = None,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.unhealthy_after_trips = unhealthy_after_trips
        self.clock = clock
        self.wall = wall
        self.store: ControlStore = store or LocalStore()
        self._listeners: list[TransitionListener] = []
        self._starting = False

    def listen(self, listener: TransitionListener) -> None:
        """Call ``listener`` after every transition (e.g. warm-up starts on ``warming``)."""
        self._listeners.append(listener)

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """While the gateway starts: a fleet found warm then is not new (no slow start)."""
        self._starting = True
        try:
            yield
        finally:
            self._starting = False

    def _commit(self, backend: Backend, record: ControlRecord) -> None:
        self.store.commit(backend, record, None)

    # ---- transitions --------------------------------------------------------------------
    def transition(self, backend: Backend, to: BackendState, reason: str) -> None:
        """Apply one checked transition (``IllegalTransition`` for a move the lifecycle does
        not allow), log it, count it, and start what it implies: the slow-start ramp on
        ``warm`` (none while starting up), the cold-start timer on ``cold`` / ``unhealthy``
        (ended on the next ``warm``; :mod:`gateway.fleet.cold_start` measures it), a
        breaker reset when it comes back through warm-up, the drain deadline's end when it
        leaves ``draining``; then the listeners. Nothing happens when it is already in ``to``."""
        if backend.state is to:
            return
        t = lifecycle.transition_of(backend, to, reason, self.wall())
        now = self.clock()
        rec = replace(backend.control(), state=to)
        if to is S.WARM:
            rec = replace(rec, warm_since=None if self._starting else now, drained=False)
            if rec.first_seen is not None:  # observed by gateway.fleet.cold_start
                rec = replace(rec, first_seen=None)
        elif to in (S.COLD, S.UNHEALTHY) and rec.first_seen is None:
            rec = replace(rec, first_seen=now)  # the cold-start timer runs until warm again
        if t.from_state is S.DRAINING:
            rec = replace(rec, drain_deadline=None)
        self.store.commit(backend, rec, t)
        level = logging.WARNING if to is S.UNHEALTHY else logging.INFO
        log.log(level, "backend %s: %s -> %s (%s)", backend.id, t.from_state, to, reason)
        self.metrics.transitions.labels(backend.id, t.from_state.value, to.value, reason).inc()
        if to is S.WARM and t.from_state is S.WARMING:
            backend.breaker.reset()  # it came back through probes and warm-up
        for listener in self._listeners:
            listener(backend, t)

    def apply(self, backend: Backend, decision: lifecycle.Decision | None) -> None:
        """:meth:`transition` as a health rule decided (nothing for None)."""
        if decision is not None:
            self.transition(backend, decision.to, decision.reason)

    # ---- holds out of rotation ------------------------------------------------------------
    def hold(
        self,
        backend: Backend,
        kind: str,
        until: float | None,
        restart_seen_after: float | None = None,
    ) -> None:
        """Keep ``backend`` out of rotation even when its probes pass: ``kind`` is
        ``admin_drain``, ``preempted``, ``restarting`` or ``gpu_fault``; ``until``:
        monotonic time the hold passes (None: until released). With
        ``restart_seen_after`` (the server's ``process_start_time_seconds`` before a
        restart hook) a scrape showing another start time releases it."""
        rec = replace(backend.control(), hold=kind, hold_until=until)
        if restart_seen_after is not None:
            rec = replace(rec, restart_seen_after=restart_seen_after)
        self._commit(backend, rec)

    def release_hold(self, backend: Backend, restart_seen: bool = False) -> None:
        """End ``backend``'s hold (``restart_seen``: the restart it waited for happened,
        which also forgets the start time it was waiting to change)."""
        rec = replace(backend.control(), hold=None, hold_until=None)
        if restart_seen:
            rec = replace(rec, restart_seen_after=None)
        self._commit(backend, rec)

    # ---- drains ---------------------------------------------------------------------------
    def set_drain_deadline(self, backend: Backend, at: float) -> None:
        """When ``backend``'s drain cuts what is still in flight (monotonic seconds)."""
        self._commit(backend, replace(backend.control(), drain_deadline=at))

    def mark_drained(self, backend: Backend) -> None:
        """A manual drain finished (nothing in flight); it stays out of rotation."""
        self._commit(backend, replace(backend.control(), drained=True))

    # ---- maintenance markers and deferrals --------------------------------------------------
    def maintenance_started(self, backend: Backend, name: str) -> None:
        """The procedure ``name`` (short/medium/long/drain/...) runs on ``backend`` now."""
        self._commit(backend, replace(backend.control(), maintenance=name))

    def maintenance_ended(self, backend: Backend) -> None:
        """No procedure runs on ``backend`` any more."""
        self._commit(backend, replace(backend.control(), maintenance=None))

    def set_deferral(self, backend: Backend, deferral: Deferral | None) -> None:
        """The due cycle held back on ``backend`` (None: none)."""
        self._commit(backend, replace(backend.control(), deferred=deferral))

    # ---- what the request path reports --------------------------------------------------------
    def auth_refused(self, backend: Backend, detail: str, status: int | None) -> None:
        """``backend`` refused the gateway's own credentials (HTTP ``status``, None when
        unknown; ``detail`` says where): a configuration error, never a health verdict.
        Counted in ``gateway_backend_config_errors_total``, logged once per detail, shown
        in ``/admin/backends`` until a model list passes."""
        self.metrics.backend_config_errors.labels(backend.id, str(status)).inc()
        if backend.config_error != detail:
            log.error(
                "CONFIGURATION ERROR: backend %s rejected the gateway's credentials (%s); "
                "check backends[%s].api_key / api_key_env",
                backend.id,
                detail,
                backend.id,
            )
        self._commit(backend, replace(backend.control(), config_error=detail))

    def clear_config_error(self, backend: Backend) -> None:
        """``backend`` accepts the gateway's credentials again."""
        if backend.config_error is not None:
            self._commit(backend, replace(backend.control(), config_error=None))

    def breaker_tripped(self, backend: Backend) -> None:
        """``backend``'s circuit breaker opened (passive outlier detection from real
        traffic, or its latency fuse). After ``unhealthy_after_trips`` trips in a row a
        serving backend is ``unhealthy`` (``breaker_open``) and must come back through
        probes and warm-up."""
        br = backend.breaker
        self.metrics.breaker_trips.labels(backend.id, br.last_trip_reason or "").inc()
        log.warning(
            "backend %s: circuit breaker open (%s, trip %d, %.0f s)",
            backend.id,
            br.last_trip_reason,
            br.trips,
            br.retry_in(),
        )
        if br.trips >= self.unhealthy_after_trips and backend.state in (
            S.WARM,
            S.WARMING,
            S.DRAINING,
            S.COOLDOWN,
        ):
            self.transition(backend, S.UNHEALTHY, "breaker_open")
