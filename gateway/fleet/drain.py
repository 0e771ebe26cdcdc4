"""Drains: take a backend out of rotation and wait for its requests, cutting what is
left at the deadline; an operator's drain and undrain, and spot preemption.

A draining backend gets no new requests; at its deadline the requests still open are cut
(streams end with an error event then ``[DONE]``; one still waiting for its answer's start
is re-sent elsewhere). The maintenance cycles drain through :meth:`Drains.drain`; the admin
API calls :meth:`Drains.start_drain` and :meth:`Drains.undrain`.
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

    async def drain(self, backend: Backend, deadline_s: float, reason: str) -> bool:
        """Stop new requests to ``backend`` at once and wait for its in-flight ones.

        At the deadline (seconds from now) the remaining requests are cut: streams end
        with an error event then ``[DONE]``; a request still waiting for its answer is
        re-sent to another backend. Returns True when the backend is still ``draining``
        with nothing in flight (False: something else changed its state meanwhile).
        """
        if backend.state in (S.WARM, S.WARMING):
            self.state.transition(backend, S.DRAINING, reason)
        if backend.state is not S.DRAINING:
            return False
        started = self.clock()
        if backend.drain_deadline is None:
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
        return True
