"""When each maintenance cycle of a backend is next due (pure: no I/O; time is passed in).

Cycles (seed 000), all periods configurable (:class:`gateway.config.LifecycleConfig`):
short (5 min, an application probe), medium (30 min or 10,000 requests served, whichever
first) and long (4 h). :func:`initial_cycle_clock` spreads the first due times of the
backends the gateway starts with over the period so they do not all come due together;
:func:`due_cycle` says which is due; :func:`cycle_started` books a started (or skipped)
one. Every :class:`~gateway.fleet.backend.Backend` owns one :class:`CycleClock` from the
moment it is built.

A backend that **joins** a running gateway (a reload, discovery, the autoscaler: all through
:meth:`gateway.fleet.fleet.Fleet.add`) was just started and is warmed up on joining: cycling
it at once costs capacity for nothing. Its first due times are one full period after it
joined plus its slot's share of the next one (:func:`joined_cycle_clock`: at least one
period, at most two, staggered by a hash of its id, :func:`spread_slot`). The same holds for
a backend that **comes back** into service after an outage (a restart, a crash, a
preemption: :func:`back_from_outage`), rebooked by :func:`came_back` when it is warm again.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gateway.config import LifecycleConfig
from gateway.core.vocab import BackendState
from gateway.fleet.records import Transition

SPREAD_SLOTS = 1024
"""Slots a joining (or returning) backend's due times are staggered over, by a hash of its
id (:func:`spread_slot`): stable, and uniform over each period however many come and go."""


class CycleKind(StrEnum):
    """The three maintenance cycles, least to most thorough."""

    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"


@dataclass(slots=True)
class CycleClock:
    """When each cycle of one backend is next due (monotonic seconds), and the request count
    at its last medium cycle (for the every-N-requests trigger)."""

    next_short: float
    next_medium: float
    next_long: float
    requests_at_medium: int = 0


def _first(now: float, every: float, index: int, count: int) -> float:
    if every <= 0:
        return math.inf
    return now + every * (index + 1) / max(1, count)


def initial_cycle_clock(index: int, count: int, now: float, cfg: LifecycleConfig) -> CycleClock:
    """First due times of backend ``index`` of ``count``, spread evenly over each period."""
    return CycleClock(
        next_short=_first(now, cfg.short.every_s, index, count),
        next_medium=_first(now, cfg.medium.every_s, index, count),
        next_long=_first(now, cfg.long.every_s, index, count),
    )


def spread_slot(backend_id: str) -> int:
    """The stagger slot of ``backend_id``: CRC-32 of its id modulo :data:`SPREAD_SLOTS`."""
    return zlib.crc32(backend_id.encode()) % SPREAD_SLOTS


def _after_join(at: float, every: float, slot: int, slots: int) -> float:
    if every <= 0:
        return math.inf
    return at + every * (1.0 + slot / max(1, slots))


def joined_cycle_clock(
    slot: int, slots: int, joined_at: float, cfg: LifecycleConfig
) -> CycleClock:
    """First due times of a backend that joined a running gateway at ``joined_at``
    (monotonic seconds): each cycle ``every_s * (1 + slot / slots)`` after it joined, i.e.
    never within one full period of joining (it was just started and warmed up), staggered
    over the following period by ``slot`` of ``slots`` (:func:`spread_slot`). A period of 0
    (the cycle disabled) is never due."""
    return CycleClock(
        next_short=_after_join(joined_at, cfg.short.every_s, slot, slots),
        next_medium=_after_join(joined_at, cfg.medium.every_s, slot, slots),
        next_long=_after_join(joined_at, cfg.long.every_s, slot, slots),
    )


def came_back(
    clock: CycleClock,
    slot: int,
    slots: int,
    now: float,
    requests_served: int,
    cfg: LifecycleConfig,
) -> None:
    """Rebook ``clock`` for a backend back in service at ``now`` (monotonic seconds) after
    an outage (:func:`back_from_outage`): as :func:`joined_cycle_clock` from ``now``, except
    that a due time never moves earlier (one already later stands). The medium request count
    starts again from ``requests_served`` (a restarted engine's prefix cache is empty)."""
    clock.next_short = max(clock.next_short, _after_join(now, cfg.short.every_s, slot, slots))
    clock.next_medium = max(clock.next_medium, _after_join(now, cfg.medium.every_s, slot, slots))
    clock.next_long = max(clock.next_long, _after_join(now, cfg.long.every_s, slot, slots))
    clock.requests_at_medium = requests_served


_OUT_OF_SERVICE = (BackendState.COLD, BackendState.UNHEALTHY)


def back_from_outage(history: Iterable[Transition]) -> bool:
    """Whether the last transition of ``history`` (oldest first) brings a backend back to
    ``warm`` through warm-up after it was out of service (``cold``: a restart hook, a
    preemption; ``unhealthy``: a crash, a GPU fault) since it was last warm. A backend's
    first ``warm`` (it never was warm before: the gateway's start, a join) is not a return,
    nor is the end of a medium cycle (``cooldown -> warm``)."""
    items = list(history)
    if not items:
        return False
    last = items[-1]
    if last.to_state is not BackendState.WARM or last.from_state is not BackendState.WARMING:
        return False
    outage = False
    for t in reversed(items[:-1]):
        if t.to_state is BackendState.WARM:
            return outage
        if t.to_state in _OUT_OF_SERVICE:
            outage = True
    return False


def due_cycle(
    clock: CycleClock, now: float, requests_served: int, cfg: LifecycleConfig
) -> CycleKind | None:
    """The most thorough cycle now due for one backend (long > medium > short), or None."""
    if now >= clock.next_long:
        return CycleKind.LONG
    every_n = cfg.medium.every_requests
    if now >= clock.next_medium or (
        every_n > 0 and requests_served - clock.requests_at_medium >= every_n
    ):
        return CycleKind.MEDIUM
    if now >= clock.next_short:
        return CycleKind.SHORT
    return None


def cycle_started(
    clock: CycleClock, kind: CycleKind, now: float, requests_served: int, cfg: LifecycleConfig
) -> None:
    """Book a started cycle: its next due time moves one period on. A long cycle also
    counts as a medium and a short one (it does more than both)."""
    inf = math.inf
    if kind is CycleKind.LONG:
        clock.next_long = now + cfg.long.every_s if cfg.long.every_s > 0 else inf
    if kind in (CycleKind.LONG, CycleKind.MEDIUM):
        clock.next_medium = now + cfg.medium.every_s if cfg.medium.every_s > 0 else inf
        clock.requests_at_medium = requests_served
    clock.next_short = now + cfg.short.every_s if cfg.short.every_s > 0 else inf


def never_due() -> CycleClock:
    """A clock on which no cycle is ever due (a backend outside any gateway's schedule,
    e.g. one the fleet simulator or a test builds alone)."""
    return CycleClock(math.inf, math.inf, math.inf)


def adopt_start(
    clock: CycleClock,
    kind: CycleKind,
    started_at: float,
    requests_served: int,
    cfg: LifecycleConfig,
) -> None:
    """Book a cycle another replica of the fleet started (fleet mode): ``started_at`` is its
    start in this replica's monotonic seconds (converted from the store's clock). Like
    :func:`cycle_started` from ``started_at``, except that a due time never moves earlier
    (a start this replica already booked, or a later one, stands): each backend's cycles then
    run once per period for the whole fleet, whichever replica ran them. The medium
    request count starts again from ``requests_served`` (this replica's count now)."""
    inf = math.inf

    def later(current: float, every: float) -> float:
        return max(current, started_at + every if every > 0 else inf)

    if kind is CycleKind.LONG:
        clock.next_long = later(clock.next_long, cfg.long.every_s)
    if kind in (CycleKind.LONG, CycleKind.MEDIUM):
        clock.next_medium = later(clock.next_medium, cfg.medium.every_s)
        clock.requests_at_medium = requests_served
    clock.next_short = later(clock.next_short, cfg.short.every_s)
