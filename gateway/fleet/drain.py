"""Drains: take a backend out of rotation and wait for its requests, cutting what is
left at the deadline; an operator's drain and undrain, and spot preemption.

A draining backend gets no new requests; at its deadline the requests still open are cut
(streams end with an error event then ``[DONE]``; one still waiting for its answer's start
is re-sent elsewhere). The maintenance cycles drain through :meth:`Drains.drain`; the admin
API calls :meth:`Drains.start_drain` and :meth:`Drains.undrain`.

The holds a GPU fault sets (``gpu_fault``, then ``restarting`` after the restart hook) are
set here too (:meth:`Drains.hold_for_gpu_fault`, :meth:`Drains.hold_restarting`), through
the :class:`gateway.fleet.sharing.SharedHolds` seam: in fleet mode the restart hook runs on
one replica and every replica holds the backend out (:meth:`Drains.apply_shared_hold`, called
by :mod:`gateway.coord.operator` for the holds other replicas publish).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config import LifecycleConfig
from gateway.core.vocab import BackendState, Cut
from gateway.fleet.backend import Backend
from gateway.fleet.procedures import Procedures
from gateway.fleet.sharing import LOCAL, SharedHolds
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState
log = logging.getLogger("gateway.fleet")


class Drains:
    """Drains under ``cfg`` (``preempt_hold_s``), run as ``procedures``; ``clock``:
    monotonic seconds. :attr:`longest_drain_s`: the longest drain since start (seconds,
    reported by drills)."""

    def __init__(
        self,
        cfg: LifecycleConfig,
        state: FleetState,
        procedures: Procedures,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.procedures = procedures
        self.metrics = metrics
        self.clock = clock
        self.longest_drain_s = 0.0
        self.shared: SharedHolds = LOCAL

    def share(self, shared: SharedHolds) -> None:
        """Share the GPU-fault holds and restart claims through ``shared`` (fleet mode)."""
        self.shared = shared

    async def drain(self, backend: Backend, deadline_s: float | None, reason: str) -> bool:
        """Stop new requests to ``backend`` at once and wait for its in-flight ones.

        At the deadline (seconds from now; None: none unless one is set later, e.g. by
        :meth:`arm_deadline`) the remaining requests are cut: streams end
        with an error event then ``[DONE]``; a request still waiting for its answer is
        re-sent to another backend. Returns True when the backend is still ``draining``
        with nothing in flight (False: something else changed its state meanwhile).
        """
        if backend.state in (S.WARM, S.WARMING):
            self.state.transition(backend, S.DRAINING, reason)
        if backend.state is not S.DRAINING:
            return False
        started = self.clock()
        if backend.drain_deadline is None and deadline_s is not None:
            self.state.set_drain_deadline(backend, started + deadline_s)
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
            self.state.transition(backend, S.COLD, "spot_preemption")
        else:
            self.state.mark_drained(backend)
            log.info("backend %s: drained (nothing in flight)", backend.id)

    def rest_over_held(self, backend: Backend) -> None:
        """A resting ``backend`` (``cooldown``) whose cycle ended while a hold keeps it out:
        a spot preemption sends it ``cold`` (as every preempted backend: its probes bring it
        back through warming once the hold is over, or it went away), any other hold (an
        admin drain) keeps it drained, out of rotation until an undrain."""
        if backend.hold == "preempted" and backend.state is S.COOLDOWN:
            self.state.transition(backend, S.COLD, "spot_preemption")
        else:
            self.state.mark_drained(backend)

    @staticmethod
    def would_start_drain(backend: Backend, preempt: bool = False) -> bool:
        """Whether :meth:`start_drain` would change anything (False: already held the same
        way, drained or preempted). The admin API asks before writing to a shared store."""
        want = "preempted" if preempt else "admin_drain"
        return not (
            backend.hold == want
            and (backend.state is not S.DRAINING or backend.drained or want == "preempted")
        )

    @staticmethod
    def would_undrain(backend: Backend) -> bool:
        """Whether :meth:`undrain` would change anything (a hold to release, or a draining
        or resting backend to return)."""
        return backend.hold is not None or backend.state in (S.DRAINING, S.COOLDOWN)

    def undrain(self, backend: Backend) -> bool:
        """Return a drained, draining or resting backend to rotation (with slow start); a
        held backend that is down (cold, unhealthy) returns when its probes pass."""
        held = backend.hold is not None
        self.state.release_hold(backend)
        if backend.state in (S.DRAINING, S.COOLDOWN):
            self.procedures.cancel(backend)
            self.state.transition(backend, S.WARM, "admin_undrain")
            return True
        return held

    def start_drain(self, backend: Backend, deadline_s: float, preempt: bool = False) -> bool:
        """Admin drain or spot preemption of ``backend``, whatever it is doing.

        The backend is held out of rotation (``hold``): an admin drain until undrain, a
        preemption until the instance goes away (or ``lifecycle.preempt_hold_s``). A warm or
        warming backend starts draining now (``deadline_s`` from now); one already draining
        keeps its procedure and gets the earlier of the two deadlines; one resting or down
        just stays out when its cycle or probes would have brought it back (a preempted one
        resting goes ``cold`` when its cycle ends, at once when none runs:
        :meth:`rest_over_held`). Returns False
        when nothing changed (already held the same way).
        """
        now = self.clock()
        want = "preempted" if preempt else "admin_drain"
        if not self.would_start_drain(backend, preempt):
            return False  # already drained / preempted
        if backend.hold != "preempted":  # a preemption is never downgraded to a drain
            self.state.hold(backend, want, now + self.cfg.preempt_hold_s if preempt else None)
        if backend.state in (S.WARM, S.WARMING):
            self.procedures.cancel(backend)  # e.g. a short cycle's probe
            reason = "spot_preemption" if preempt else "admin_drain"
            self.state.transition(backend, S.DRAINING, reason)
            self.state.set_drain_deadline(backend, now + deadline_s)
            self.procedures.run(
                backend,
                "preempt" if preempt else "drain",
                self.manual_drain(backend, deadline_s, preempt),
            )
        elif backend.state is S.DRAINING:
            if backend.drain_deadline is None or now + deadline_s < backend.drain_deadline:
                self.state.set_drain_deadline(backend, now + deadline_s)
            if not self.procedures.busy(backend):
                self.procedures.run(
                    backend, "drain", self.manual_drain(backend, deadline_s, preempt)
                )
        elif backend.state is S.COOLDOWN and preempt and not self.procedures.busy(backend):
            self.rest_over_held(backend)  # resting, its cycle over (e.g. drained): cold now
        return True

    # ---- discovery: an endpoint terminating or gone (gateway.fleet.membership) -----------------
    def leave(self, backend: Backend, reason: str, deadline_s: float | None) -> None:
        """Discovery says ``backend`` is going away (``reason``: ``endpoint_terminating``,
        ``endpoint_removed``, ``endpoint_moved``): held out of rotation (``hold:
        leaving``, unless another hold already keeps it out) and, when warm or warming,
        drained as the procedure ``leave`` (then marked drained). ``deadline_s`` (seconds
        from now): when what is still in flight is cut; None: never (the endpoint still
        serves), until :meth:`arm_deadline`. Idempotent."""
        if backend.hold is None:
            self.state.hold(backend, "leaving", None)
        if backend.state in (S.WARM, S.WARMING):
            self.procedures.cancel(backend)  # e.g. a short cycle's probe
            self.state.transition(backend, S.DRAINING, reason)
            if deadline_s is not None:
                self.state.set_drain_deadline(backend, self.clock() + deadline_s)
            self.procedures.run(backend, "leave", self._leave(backend, reason))
        elif deadline_s is not None:
            self.arm_deadline(backend, deadline_s)

    async def _leave(self, backend: Backend, reason: str) -> None:
        if await self.drain(backend, None, reason):
            self.state.mark_drained(backend)
            log.info("backend %s: drained for discovery (%s)", backend.id, reason)

    def arm_deadline(self, backend: Backend, deadline_s: float) -> None:
        """A draining ``backend``'s drain cuts what is left ``deadline_s`` seconds from
        now, or at its earlier deadline already set."""
        if backend.state is not S.DRAINING:
            return
        at = self.clock() + deadline_s
        if backend.drain_deadline is None or at < backend.drain_deadline:
            self.state.set_drain_deadline(backend, at)

    def rejoin(self, backend: Backend) -> None:
        """Discovery sees ``backend`` serving again: its ``leaving`` hold ends and, when
        its discovery drain is running or done, it returns to ``warm`` (reason
        ``endpoint_back``, with slow start). A drain of another kind (an operator's, a
        maintenance cycle's) is left as it is; a cold or unhealthy backend returns through
        its probes."""
        if backend.hold != "leaving":
            return
        self.state.release_hold(backend)
        if backend.state is S.DRAINING and self.procedures.running(backend) in (None, "leave"):
            self.procedures.cancel(backend)
            self.state.transition(backend, S.WARM, "endpoint_back")

    # ---- GPU faults: holds every replica keeps -----------------------------------------------
    def hold_for_gpu_fault(self, backend: Backend, reason: str) -> None:
        """A GPU fault (``reason``: ``gpu_xid`` / ``gpu_ecc``): ``unhealthy`` now (from a
        serving state) and held out (``gpu_fault``) until the restart is seen or an operator
        undrains it. The same on a replica that learns it from another one."""
        if backend.state in (S.WARM, S.WARMING, S.DRAINING, S.COOLDOWN):
            self.state.transition(backend, S.UNHEALTHY, reason)
        self.state.hold(backend, "gpu_fault", None)

    def hold_restarting(self, backend: Backend, hold_s: float) -> None:
        """The restart hook ran: hold ``backend`` ``restarting`` for ``hold_s`` seconds (a
        failed probe ends it sooner: the old process went away) and publish the hold."""
        self.state.hold(backend, "restarting", self.clock() + hold_s)
        self.shared.restart_held(backend, hold_s)

    def apply_shared_hold(
        self, backend: Backend, kind: str, until: float | None, reason: str
    ) -> None:
        """A hold another replica published: ``gpu_fault`` (as :meth:`hold_for_gpu_fault`)
        or ``restarting`` until ``until`` (monotonic seconds here)."""
        if kind == "gpu_fault":
            self.hold_for_gpu_fault(backend, reason)
        else:
            self.state.hold(backend, kind, until)
