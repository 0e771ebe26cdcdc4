"""Following the maintenance leases other replicas hold (fleet mode): each backend under
another replica's lease leaves rotation here too, through this replica's own
:class:`gateway.fleet.state.FleetState` transitions, so ``/admin/backends``, the metrics,
the stagger rule and the request path all see it out.

The decision is pure (:func:`gateway.fleet.leases.mirror_action`); this module applies it:

* ``draining`` (the holder drains): ``warm -> draining`` (``fleet_cooldown_<reason>`` or
  ``fleet_restart_<reason>``) with the lease's drain deadline, and a ``fleet_<cycle>``
  procedure that drains this replica's own requests (:meth:`gateway.fleet.drain.Drains.
  drain`: cut at the shared deadline) and then stays until the cycle ends;
* ``cooldown`` (the holder's drain is over everywhere): ``draining -> cooldown``
  (``fleet_drained``);
* ``restarting`` (the holder runs the restart hook): ``cold`` (``fleet_restarted``), held
  ``restarting`` like the holder (until the restart is seen or ``lifecycle.restart_hold_s``);
* the cycle ended (the record closed), or, without a record, the lease last seen would have
  run out (its expiry, or the end of its rest if later): back to ``warm``
  (``fleet_cooldown_done``, with slow start), unless an operator holds it out.

While following, the replica publishes its in-flight count (:meth:`LeaseMirror.ack_token`)
so the holder knows when the whole fleet has drained the backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.controller import FleetController
from gateway.fleet.cycles import CycleKind
from gateway.fleet.leases import LeaseRecord, MirrorAction, mirror_action, takes_out

S = BackendState
log = logging.getLogger("gateway.coord")

FOLLOW = "fleet_"  # the prefix of a following procedure's name (fleet_medium, fleet_long)


@dataclass(slots=True)
class _Following:
    """A backend this replica holds out for another's lease: the cycle's token, and the
    latest moment (monotonic) the lease last seen would still hold it out."""

    token: int
    keep_until: float | None


class LeaseMirror:
    """This replica's view of the leases other replicas hold on ``controller``'s backends
    (``replica_id``: this replica; ``clock``: monotonic seconds)."""

    def __init__(
        self,
        controller: FleetController,
        replica_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.replica_id = replica_id
        self.clock = clock
        self.following: dict[str, _Following] = {}

    def ack_token(self, b: Backend) -> int | None:
        """The cycle whose drain this replica reports its in-flight count for on ``b``: the
        one it follows, once ``b`` is out of rotation here (None: nothing to report)."""
        f = self.following.get(b.id)
        if f is None or b.state is S.WARM:
            return None
        return f.token

    async def apply(self, b: Backend, rec: LeaseRecord | None) -> bool:
        """Bring ``b``'s local state in line with ``rec`` (None: no record read). Returns
        True when the lease's holder stopped renewing it (the caller tries to take it
        over)."""
        f = self.following.get(b.id)
        now = self.clock()
        action = mirror_action(rec, f is not None, b.state, now, f.keep_until if f else None)
        if action is MirrorAction.TAKE_OVER:
            return True
        st = self.controller.state
        if action is MirrorAction.DRAIN and rec is not None:
            await self._drain(b, rec)
        elif action is MirrorAction.COOLDOWN:
            st.transition(b, S.COOLDOWN, "fleet_drained")
        elif action is MirrorAction.RESTART:
            before = b.load.process_start_s if b.load is not None else None
            hold_s = self.controller.cfg.lifecycle.restart_hold_s
            await self._stop_following(b)
            st.hold(b, "restarting", now + hold_s, restart_seen_after=before)
            st.transition(b, S.COLD, "fleet_restarted")
            if rec is None or not rec.open:
                return False
        elif action is MirrorAction.RETURN:
            await self._stop_following(b)
            if b.state in (S.DRAINING, S.COOLDOWN) and b.hold is None:
                st.transition(b, S.WARM, "fleet_cooldown_done")
            elif b.state is S.COOLDOWN and b.hold == "preempted":
                self.controller.drains.rest_over_held(b)  # preempted while it rested: cold
            return False
        elif action is MirrorAction.NONE:
            if f is not None:
                await self._stop_following(b)
            return False
        if rec is not None and rec.open and takes_out(rec.cycle):
            if b.state is not S.WARM or b.id in self.following:
                keep = rec.expires_at
                if rec.rest_end is not None and (keep is None or rec.rest_end > keep):
                    keep = rec.rest_end
                self.following[b.id] = _Following(rec.token, keep)
        return False

    async def _drain(self, b: Backend, rec: LeaseRecord) -> None:
        """Take ``b`` out for ``rec``'s cycle and drain this replica's requests on it."""
        procedures = self.controller.procedures
        if procedures.busy(b):
            await procedures.cancel_and_wait(b)  # e.g. an engine probe of a short cycle
        if b.state is not S.WARM:
            return
        kind = "cooldown" if rec.cycle is CycleKind.MEDIUM else "restart"
        reason = f"fleet_{kind}_{rec.reason}"
        self.controller.state.transition(b, S.DRAINING, reason)
        if rec.drain_deadline is not None:
            self.controller.state.set_drain_deadline(b, rec.drain_deadline)
        log.info(
            "backend %s: out of rotation for %s's %s cycle (%s)",
            b.id, rec.holder, rec.cycle.value, rec.reason,
        )
        procedures.run(b, f"{FOLLOW}{rec.cycle.value}", self._follow(b, reason))

    async def _follow(self, b: Backend, reason: str) -> None:
        """Drain this replica's requests on ``b`` (cut at the shared deadline), then stay
        (the backend's procedure) until the cycle ends."""
        deadline = b.drain_deadline
        lc = self.controller.cfg.lifecycle
        left = lc.drain_deadline_s if deadline is None else max(0.0, deadline - self.clock())
        await self.controller.drains.drain(b, left, reason)
        await asyncio.Event().wait()  # ended by _stop_following (or the gateway's stop)

    async def _stop_following(self, b: Backend) -> None:
        self.following.pop(b.id, None)
        running = self.controller.procedures.running(b)
        if running is not None and running.startswith(FOLLOW):
            await self.controller.procedures.cancel_and_wait(b)
