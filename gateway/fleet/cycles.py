"""When each maintenance cycle of a backend is next due (pure: no I/O; time is passed in).

Cycles (seed 000), all periods configurable (:class:`gateway.config.LifecycleConfig`):
short (5 min, an application probe), medium (30 min or 10,000 requests served, whichever
first) and long (4 h). :func:`initial_cycle_clock` spreads first due times over the period
so backends do not all come due together; :func:`due_cycle` says which is due;
:func:`cycle_started` books a started (or skipped) one. Every
:class:`~gateway.fleet.backend.Backend` owns one :class:`CycleClock` from the moment it is
built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from gateway.config import LifecycleConfig


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
