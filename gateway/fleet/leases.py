"""Maintenance leases: the seam through which a maintenance cycle runs once for the whole
fleet (pure: no I/O; time is passed in).

A cycle (short, medium, long; a thermal or admin cooldown) runs under a
:class:`MaintenanceLease` on its backend, taken from a :class:`MaintenanceLeases` before the
cycle changes anything and given back when it ends. One gateway (the embedded default) has
:class:`LocalLeases`: every lease is granted at once, nobody else drains, nothing is ever lost,
so the cycles behave exactly as without leases. In fleet mode
:class:`gateway.coord.leases.FleetLeases` takes them in the shared store (one holder per
backend, the stagger rule of :func:`gateway.fleet.lifecycle.may_take_out` counted over every
replica, each cycle kind started once per period) and mirrors the leases other replicas hold
onto this replica's backends (:func:`mirror_action`).

The lease record (:class:`MaintenanceLease` for the holder, :class:`LeaseRecord` as others
see it) carries what the other replicas need to follow the cycle: the holder, the cycle
kind and reason, its phase (:class:`LeasePhase`), the drain deadline, the end of the rest,
whether vLLM was put to sleep and whether the prefix cache was reset (so a replica taking
over a lease whose holder died finishes the cycle without repeating a step). Times here are
this replica's monotonic seconds; the store keeps its own clock and the fleet implementation
converts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gateway.config import LifecycleConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import CycleKind
from gateway.fleet.lifecycle import max_unavailable

S = BackendState


class LeasePhase(StrEnum):
    """Where a cycle under a lease is: a short cycle's engine probe (the backend stays in
    rotation), draining, resting in cooldown, or restarting (the long cycle's hook ran or is
    running: the backend goes ``cold``)."""

    PROBING = "probing"
    DRAINING = "draining"
    COOLDOWN = "cooldown"
    RESTARTING = "restarting"


def takes_out(cycle: CycleKind) -> bool:
    """Whether a cycle of this kind takes its backend out of rotation (medium, long)."""
    return cycle is not CycleKind.SHORT


@dataclass(slots=True)
class MaintenanceLease:
    """A lease this replica holds on ``backend`` for one ``cycle`` (``reason``: ``scheduled``,
    ``thermal``, ``admin``, ...). Changed only by the cycle running under it (through its
    methods; each change bumps ``version`` so the fleet implementation publishes it) and
    :meth:`lose` by the lease keeper. Times: monotonic seconds. ``token``: the store's
    number of this cycle (0 without a store). ``taken_over``: this replica took it over from a
    holder that stopped renewing it."""

    backend: str
    cycle: CycleKind
    reason: str
    phase: LeasePhase
    drain_deadline: float | None = None
    rest_end: float | None = None
    slept: bool = False
    reset_done: bool = False
    token: int = 0
    taken_over: bool = False
    lost: bool = False
    version: int = 0

    def enter(self, phase: LeasePhase) -> None:
        """The cycle moved to ``phase``."""
        if phase is not self.phase:
            self.phase = phase
            self.version += 1

    def resting_until(self, end: float | None) -> None:
        """The rest ends at ``end`` (monotonic seconds; None: when the GPU is cool)."""
        self.rest_end = end
        self.version += 1

    def mark_slept(self, slept: bool) -> None:
        """vLLM was put to sleep (True) or woken (False)."""
        if slept is not self.slept:
            self.slept = slept
            self.version += 1

    def mark_reset(self) -> None:
        """The prefix cache was reset (once per medium cycle)."""
        if not self.reset_done:
            self.reset_done = True
            self.version += 1

    def lose(self) -> None:
        """The store says another replica holds this backend's lease now: this cycle stops
        its side effects (the new holder finishes it)."""
        self.lost = True


class MaintenanceLeases(Protocol):
    """Where maintenance leases come from (the module docstring: :class:`LocalLeases` for
    one gateway, :class:`gateway.coord.leases.FleetLeases` in fleet mode)."""

    @property
    def shared(self) -> bool:
        """Whether other replicas share the leases (taking one is then a store call)."""
        ...

    async def acquire(
        self,
        backend: Backend,
        cycle: CycleKind,
        reason: str,
        drain_deadline: float | None,
        force: bool = False,
    ) -> MaintenanceLease | None:
        """A lease on ``backend`` for ``cycle``, or None when refused: another replica holds
        one, the stagger rule forbids taking it out (unless ``force``), this kind was already
        started on it since this replica last booked one, or the store does not answer.
        ``drain_deadline``: when its drain cuts what is left (monotonic seconds; None for a
        short cycle)."""
        ...

    async def fleet_drained(self, backend: Backend, lease: MaintenanceLease) -> None:
        """Return once no replica has requests in flight on ``backend`` (each cuts its own at
        the drain deadline), or a little after the deadline."""
        ...

    def confirmed(self, lease: MaintenanceLease) -> bool:
        """Whether the lease is known to stand in the store now (renewed within its TTL):
        a cycle takes no new step that the other replicas must follow (vLLM sleep) without
        it."""
        ...

    async def publish(self, lease: MaintenanceLease) -> bool:
        """Write ``lease``'s record now (before a step a replica taking the cycle over must
        not repeat); a refusal marks it lost. Returns whether the store took it (never
        raises for a store failure)."""
        ...

    async def release(self, lease: MaintenanceLease) -> None:
        """The cycle ended (whatever its outcome): give the lease back."""
        ...


class LocalLeases:
    """One gateway: every lease granted at once, nobody else to wait for, never lost."""

    @property
    def shared(self) -> bool:
        """Never: one process."""
        return False

    async def acquire(
        self,
        backend: Backend,
        cycle: CycleKind,
        reason: str,
        drain_deadline: float | None,
        force: bool = False,
    ) -> MaintenanceLease | None:
        """Granted (no suspension: the caller continues in the same step of the loop)."""
        phase = LeasePhase.DRAINING if takes_out(cycle) else LeasePhase.PROBING
        return MaintenanceLease(backend.id, cycle, reason, phase, drain_deadline)

    async def fleet_drained(self, backend: Backend, lease: MaintenanceLease) -> None:
        """Nothing to wait for: the local drain is the whole drain."""

    def confirmed(self, lease: MaintenanceLease) -> bool:
        """Always."""
        return True

    async def publish(self, lease: MaintenanceLease) -> bool:
        """Nobody else reads it: always taken."""
        return True

    async def release(self, lease: MaintenanceLease) -> None:
        """Nothing to give back."""


# ---- the fleet-wide stagger rule ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StaggerGroup:
    """The backends of one ``model`` a cycle on a backend must be staggered with: ``peers``
    (every backend serving it, that one included), ``limit`` (how many may be out at once,
    :func:`gateway.fleet.lifecycle.max_unavailable`) and ``out`` (the peers this replica sees
    out of rotation now, that backend excluded). The store adds the peers under an open
    lease that takes them out, so the rule holds over every replica."""

    model: str
    peers: tuple[str, ...]
    limit: int
    out: tuple[str, ...]


def stagger_groups(
    backend: Backend, fleet: Sequence[Backend], cfg: LifecycleConfig
) -> list[StaggerGroup]:
    """One :class:`StaggerGroup` per model ``backend`` serves: what the store's acquire
    script checks with :func:`may_take_out_fleet` (the rule of
    :func:`gateway.fleet.lifecycle.may_take_out`, over the union of this replica's view and
    the leases)."""
    out: list[StaggerGroup] = []
    for model in backend.models:
        peers = [b for b in fleet if model in b.models]
        out.append(
            StaggerGroup(
                model,
                tuple(b.id for b in peers),
                max_unavailable(len(peers), cfg),
                tuple(b.id for b in peers if b is not backend and b.state is not S.WARM),
            )
        )
    return out


def may_take_out_fleet(backend: str, groups: Sequence[StaggerGroup], leased: set[str]) -> bool:
    """The acquire script's stagger check, in Python (the script is its twin; the unit
    tests hold them to the same cases): for every group, the backends out are those seen out
    here plus those under an open lease that takes them out (``leased``); taking ``backend``
    out must leave at least one other peer warm and at most ``limit`` out."""
    for g in groups:
        out = (set(g.out) | (leased & set(g.peers))) - {backend}
        warm_others = len(g.peers) - 1 - len(out)
        if warm_others <= 0 or len(out) + 1 > g.limit:
            return False
    return True


# ---- how a replica follows another's lease ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A backend's cycle record as read from the store, in this replica's monotonic
    seconds: ``holder`` (replica id), ``token`` (the cycle's number), ``open`` (the cycle has
    not ended), ``expires_at`` (when the holder's lease runs out unless renewed; None: it
    already has, the holder stopped renewing), and the fields of :class:`MaintenanceLease`."""

    backend: str
    holder: str
    token: int
    cycle: CycleKind
    reason: str
    phase: LeasePhase
    open: bool
    expires_at: float | None
    drain_deadline: float | None = None
    rest_end: float | None = None
    slept: bool = False
    reset_done: bool = False


class MirrorAction(StrEnum):
    """What a replica does to its own view of a backend under another replica's lease."""

    NONE = "none"  # nothing to follow
    KEEP = "keep"  # following; the local state already matches
    DRAIN = "drain"  # take it out of rotation and drain this replica's requests
    COOLDOWN = "cooldown"  # the holder's drain is over: resting
    RESTART = "restart"  # the holder ran the restart hook: cold until probes bring it back
    RETURN = "return"  # the cycle ended (or the lease last seen ran out): back to rotation
    TAKE_OVER = "take_over"  # the holder stopped renewing: finish the cycle here


def mirror_action(
    rec: LeaseRecord | None,
    following: bool,
    state: BackendState,
    now: float,
    keep_until: float | None,
) -> MirrorAction:
    """What to do with a backend this replica holds no lease on.

    ``rec``: its cycle record as just read (None: none in the store, e.g. after a restart of
    the store, or not readable: the store is down). ``following``: this replica took it out
    for another's lease. ``state``: its local state. ``now``: monotonic seconds.
    ``keep_until``: while following, the latest moment the lease last seen would still hold
    it out (its expiry, or the end of the rest it announced if later): past it, without a
    fresh record, the backend returns to rotation (never stuck out). A cycle that ended in
    its ``restarting`` phase (the restart hook ran) sends the backend ``cold`` instead.
    """
    out_states = (S.DRAINING, S.COOLDOWN)
    if rec is None or not rec.open:
        if not following:
            return MirrorAction.NONE
        if rec is None and keep_until is not None and now < keep_until:
            return MirrorAction.KEEP  # nothing read (store down or emptied): as last seen
        if state not in out_states:
            return MirrorAction.NONE
        if rec is not None and rec.phase is LeasePhase.RESTARTING:
            return MirrorAction.RESTART  # it ended restarting (the round in between missed)
        return MirrorAction.RETURN
    if rec.expires_at is None or now >= rec.expires_at:
        return MirrorAction.TAKE_OVER
    if not takes_out(rec.cycle):
        return MirrorAction.NONE
    if state is S.WARM:
        return MirrorAction.DRAIN
    if rec.phase is LeasePhase.RESTARTING:
        return MirrorAction.RESTART if state in out_states else MirrorAction.KEEP
    if rec.phase is LeasePhase.COOLDOWN and state is S.DRAINING and following:
        return MirrorAction.COOLDOWN
    return MirrorAction.KEEP


def drained_everywhere(acks: dict[str, str], token: int, others: Sequence[str]) -> bool:
    """Whether every other live replica (``others``) reported nothing in flight on the
    backend for the cycle ``token``. ``acks``: replica id -> ``"<token>:<in flight>"``, as
    each replica following the lease publishes it (only once it has the backend out of
    rotation)."""
    for rid in others:
        raw = acks.get(rid)
        if raw is None:
            return False
        tok, _, count = raw.partition(":")
        if tok != str(token) or count != "0":
            return False
    return True
