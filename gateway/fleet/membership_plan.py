"""Pure: what a discovery snapshot changes in the fleet (:func:`plan`), and when a backend
that left the snapshot may be taken out of the fleet (:func:`removable`).

:mod:`gateway.fleet.membership` applies the plan (the only code that adds backends to and
removes them from the :class:`~gateway.fleet.fleet.Fleet`); nothing here does I/O or reads a
clock. The rules, per endpoint id (conditions as in Kubernetes' EndpointSlice API,
``ready`` / ``serving`` / ``terminating``; a DNS record is serving and never terminating):

* **new** (not in the fleet): added when it is serving and not terminating (it enters
  ``cold``: probes, warm-up and slow start before it gets traffic); otherwise it waits for a
  later snapshot;
* **terminating**: drained (no new requests; in-flight ones finish). While it still says
  ``serving`` nothing is ever cut (no deadline: the pod's own termination grace period
  bounds it); once it stops serving, the drain gets a deadline;
* **gone** from the snapshot: drained with a deadline, then removed from the fleet once
  nothing is in flight there (:func:`removable`), or its deadline (plus a grace for the
  cut requests to unwind) has passed;
* **back** (in the snapshot again, or no longer terminating, while still in the fleet):
  returns to rotation (undrained); one already removed is added again as new (``cold``);
* **moved** (same id, another URL): the old one leaves as if gone; the new one is added
  once the old one is out;
* **static** ids (the ``backends:`` list) are never touched; a discovered endpoint with a
  static id, or at a static backend's URL (the same server twice: its maintenance would
  drain one id while the other still sends it requests), is ignored
  (:attr:`Plan.collisions`, warned about by the caller);
* not serving and not terminating (failing its readiness probe) while in the fleet:
  nothing changes here, the gateway's own health probes judge it.

Only ids discovery added are in ``known``; the outcome is a :class:`Plan` of actions.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gateway.fleet.discovery import Endpoint

# Reasons of the drains discovery starts (transition reasons, ``/admin/backends`` history).
TERMINATING = "endpoint_terminating"
REMOVED = "endpoint_removed"
MOVED = "endpoint_moved"

# Seconds after a leaving backend's drain deadline when it is removed even though a request
# still counts as in flight there: the deadline cut every open request, so this only covers
# the time their tasks take to unwind (a cut stream's last write, a retry elsewhere).
REMOVE_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class Known:
    """A discovered backend in the fleet, as :func:`plan` needs it: its ``url``, whether
    discovery is draining it (``leaving``) and whether that drain has a deadline
    (``deadline``)."""

    url: str
    leaving: bool = False
    deadline: bool = False


@dataclass(frozen=True, slots=True)
class Leave:
    """Drain backend ``id`` for ``reason`` (:data:`TERMINATING`, :data:`REMOVED`,
    :data:`MOVED`); ``deadline``: whether the drain may cut what is left at its deadline
    (False while the endpoint still serves)."""

    id: str
    reason: str
    deadline: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """What one snapshot changes: endpoints to ``add`` (as ``cold``), backends to drain
    (``leave``: started, or given a deadline now), backends to return to rotation
    (``rejoin``), ids no longer in the snapshot (``gone``: removed once :func:`removable`),
    and discovered ids that collide with static ones (``collisions``, ignored)."""

    add: tuple[Endpoint, ...] = ()
    leave: tuple[Leave, ...] = ()
    rejoin: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    collisions: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """Whether the snapshot changes nothing."""
        return not (self.add or self.leave or self.rejoin or self.gone)


def plan(
    known: Mapping[str, Known],
    snapshot: Sequence[Endpoint],
    static_ids: Collection[str],
    static_urls: Collection[str] = (),
) -> Plan:
    """The changes ``snapshot`` (the source's whole current set; a repeated id: the first
    wins) asks of the fleet whose discovered backends are ``known`` (by id), never touching
    ``static_ids`` and ignoring endpoints at ``static_urls`` (``scheme://host:port``). The
    rules are the module docstring's."""
    add: list[Endpoint] = []
    leave: list[Leave] = []
    rejoin: list[str] = []
    collisions: list[str] = []
    seen: set[str] = set()
    moved: set[str] = set()
    for e in snapshot:
        if e.id in seen:
            continue
        seen.add(e.id)
        if e.id in static_ids or e.url in static_urls:
            collisions.append(e.id)
            continue
        k = known.get(e.id)
        if k is None:
            if e.serving and not e.terminating:
                add.append(e)
            continue
        if k.url != e.url:
            moved.add(e.id)
            if not (k.leaving and k.deadline):
                leave.append(Leave(e.id, MOVED, True))
            continue
        if e.terminating:
            cut = not e.serving
            if not k.leaving or (cut and not k.deadline):
                leave.append(Leave(e.id, TERMINATING, cut))
        elif k.leaving:
            rejoin.append(e.id)
    gone = [i for i in known if i not in seen or i in moved]
    for i in gone:
        k = known[i]
        if i not in moved and not (k.leaving and k.deadline):
            leave.append(Leave(i, REMOVED, True))
    return Plan(tuple(add), tuple(leave), tuple(rejoin), tuple(gone), tuple(collisions))


def removable(in_flight: int, deadline: float | None, now: float) -> bool:
    """Whether a backend gone from the snapshot may leave the fleet now: nothing in flight
    there, or its drain ``deadline`` (monotonic seconds; None: none) passed more than
    :data:`REMOVE_GRACE_S` ago (``now``: monotonic seconds)."""
    if in_flight <= 0:
        return True
    return deadline is not None and now >= deadline + REMOVE_GRACE_S
