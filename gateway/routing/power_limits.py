"""Power limits after the clocks, before shedding (issue 21): the second lever (pure).

When a power domain's clock caps all sit at their floor
(:meth:`gateway.routing.clocks.ClockController.exhausted`) and its draw is still over
``domain_high_ratio`` of the budget, the gateway sets each of the domain's GPUs' power limit
(what ``nvmlDeviceSetPowerManagementLimit`` does: the GPU's firmware then holds its draw
under the limit by lowering its clocks further, down to the bottom of its DVFS range) before
it refuses any request for power. Only when the limits are set too may power shedding
start (:class:`gateway.routing.clocks.PowerShedGate`).

**The rule: the domain's budget split over its GPUs.** Each GPU the gateway controls gets

    limit_w = (power_limit_ratio x budget_w - draw of the domain's uncontrolled GPUs)
              / number of controlled GPUs

clamped to the GPU's own range (``power_limit_range_w`` of ``GET /control``, i.e.
``nvmlDeviceGetPowerManagementLimitConstraints``). This is the power capping of the power
oversubscription literature: POLCA (Patel et al., "Characterizing Power Management
Opportunities for LLMs in the Cloud", ASPLOS 2024) caps GPU power once frequency locking no
longer keeps a row under its budget, and TAPAS (Stojkovic et al., ASPLOS 2025) caps the
GPUs of a row at their share of its budget; the fleet simulator's facility does the same
with the whole budget (``budget / GPUs``, :mod:`gateway.sim.fleet`). The gateway aims at
``power_limit_ratio`` (0.78) of the budget instead, so it acts before the facility does, and
at a draw inside the clocks' hysteresis band (above ``domain_low_ratio``: limits that bind
do not release themselves; below the lowest ``power_shed_levels``, 0.8: limits that bind do
not shed). The draw the limits cannot reach (GPUs without a control endpoint) is taken off
the budget first.

**Steps and hysteresis** (one change per domain per ``interval_s``): limits are set once the
clocks have been at their floor for ``interval_s`` (their last step's effect is seen first)
with the draw at or over ``domain_high_ratio``; while it stays there, a limit only ever moves
down (the share is computed again: the uncontrolled draw may have grown). Below
``domain_low_ratio`` one backend's limits are cleared per ``interval_s`` (back to the GPU's
default), the least bound first (lowest mean draw over its limits), once held their minimum
time, and only when the domain would stay under ``domain_high_ratio`` with that backend
back at the draw it had when its limits were set (so a load that has not fallen does not
flip the limits off and on: a GPU under a limit that binds draws its limit, the draw sits
near ``power_limit_ratio``, and a dip of a few percent must not release it); between the
two marks nothing moves. While any limit of a domain is set its clock caps do not step up
(the last lever in is the first out: :meth:`PowerLimitController.holding`). Limits count as
spent
(:meth:`PowerLimitController.exhausted`: shedding may start) once they have been set for
``interval_s``; the driver also waits until the GPUs' telemetry shows them, so their effect
on the draw is seen before any request is refused.

**Smoothed draws and a minimum hold** (no set/release flapping; issue 21): every decision
reads the draws over a window of ``smooth_intervals x interval_s`` (3 rounds by default,
:class:`gateway.routing.draw_window.DrawWindow`), not one sample: the high mark is tested
on the domain's mean draw of the window; the release reads the domain with each controlled
backend at its window's highest reading (the uncontrolled GPUs at their mean), so one low
reading (a GPU sampled between two engine steps) neither crosses the low mark nor shrinks
the load a release would bring back; the draw "before the limit" is the backend's highest
reading of the window when the limit was set, of those since its clocks sat at their floor
(what it would draw again, its clocks held there, were the limit cleared); a backend whose
highest reading reaches :data:`BINDING_SHARE` of its limits is still held by them (its
demand, the limit hides, may have grown as load moved between backends) and is not
released. A limit, once
set, is held at least ``min_hold_intervals x interval_s`` (5 rounds) before it may be
released, and the domain's draw must have read under ``domain_low_ratio`` (as above, with
each controlled backend at its window's highest reading) for ``release_stable_intervals x
interval_s`` (5 rounds) without a break: a stabilization window on the way down only, as the
Kubernetes HorizontalPodAutoscaler's scale-down ``stabilizationWindowSeconds`` (setting
acts within a window, releasing waits out a load's short dips; the CI drill of
``tests/thermal/test_power_limits.py`` saw a limit released in a dip shorter than a second
under a steady load).

Everything takes time and readings as arguments (seconds, W); no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.config import ClockControlConfig
from gateway.routing.draw_window import DrawWindow
from gateway.routing.thermal import DomainStatus

_EPS = 1e-6

BINDING_SHARE = 0.95
"""A backend whose highest reading of the window reaches this share of its limits (all its
GPUs) is held by them: its demand is at least the limit, and what it would draw released
is unknown, so it is not released (the limit is met to within a few percent: a GPU's power
capping holds the mean draw at the limit; telemetry adds the noise)."""


@dataclass(frozen=True, slots=True)
class LimitView:
    """What the power-limit rule reads of one backend: its power domain, its GPUs under the
    gateway's control (``gpus``), the power-limit range all of them accept (W: the highest
    bottom and the lowest top of ``power_limit_range_w``) and its draw now (W, all its GPUs;
    None: no fresh reading)."""

    backend_id: str
    domain: str | None
    gpus: int
    min_w: float
    max_w: float
    power_w: float | None


@dataclass(frozen=True, slots=True)
class LimitChange:
    """One backend's power limit set or cleared: ``watts`` is per GPU (None: cleared, back to
    the default); ``reason`` ``power`` (set) or ``release``."""

    backend_id: str
    watts: float | None
    previous_w: float | None
    reason: str


class PowerLimitController:
    """The power limits of every backend (module docstring). Call :meth:`decide` once per GPU
    telemetry round, after the clock controller; apply the :class:`LimitChange` list."""

    def __init__(self, cfg: ClockControlConfig) -> None:
        self.cfg = cfg
        self._limits: dict[str, float] = {}  # backend -> per-GPU limit (W) set now
        self._set_at: dict[str, float] = {}  # backend -> when its limit was first set
        self._before_w: dict[str, float | None] = {}  # backend -> its draw then (W)
        self._domain_at: dict[str, float] = {}
        self._floor_since: dict[str, float] = {}
        self._low_since: dict[str, float] = {}  # domain -> since when it reads under low
        # draws of the domains and backends over smooth_intervals x interval_s (W)
        self._draw = DrawWindow(cfg.smooth_intervals * cfg.interval_s)

    def limit_w(self, backend_id: str) -> float | None:
        """The per-GPU limit set on ``backend_id`` now (W), None when none."""
        return self._limits.get(backend_id)

    def limits(self) -> dict[str, float]:
        """Every limited backend's per-GPU limit (W)."""
        return dict(self._limits)

    def exhausted(self, members: Iterable[str], now: float) -> bool:
        """Whether every one of these backends has had its power limit set for at least
        ``interval_s`` at ``now`` (seconds: the limits' effect is seen in the draw): nothing
        more to do here, power shedding may start."""
        due = now - self.cfg.interval_s + _EPS
        return all(self._set_at.get(b, math.inf) <= due for b in members)

    def holding(self, domains: Mapping[str, Iterable[str]]) -> set[str]:
        """The domains (name -> member backends) with a limit set on any member: their
        clock caps must not step up before the limits are cleared."""
        return {d for d, members in domains.items() if any(b in self._limits for b in members)}

    def adopt(self, backend_id: str, watts: float) -> None:
        """A limit found set on ``backend_id``'s GPUs (W) when this controller starts to
        drive them (another gateway replica set it): kept, and cleared by the rule."""
        self._limits[backend_id] = watts
        self._set_at[backend_id] = -math.inf

    def forget(self, backend_id: str) -> None:
        """Drop a backend that left the fleet (or whose agent stopped answering)."""
        self._limits.pop(backend_id, None)
        self._set_at.pop(backend_id, None)
        self._before_w.pop(backend_id, None)
        self._draw.forget(_backend_key(backend_id))

    def decide(
        self,
        now: float,
        views: Sequence[LimitView],
        domains: Mapping[str, DomainStatus],
        clocks_floor: Mapping[str, bool],
    ) -> list[LimitChange]:
        """One step at ``now`` (seconds) over the backends ``views`` (those with a control
        endpoint); ``clocks_floor``: per domain, whether its clock caps are all at their
        floor. Returns the limits that changed."""
        by_domain: dict[str, list[LimitView]] = {}
        for v in views:
            if v.domain is not None and v.gpus > 0:
                by_domain.setdefault(v.domain, []).append(v)
                if v.power_w is not None:
                    self._draw.add(_backend_key(v.backend_id), now, v.power_w)
        out: list[LimitChange] = []
        for name, members in sorted(by_domain.items()):
            dom = domains.get(name)
            if dom is None or dom.budget_w <= 0:
                continue
            self._draw.add(_domain_key(name), now, dom.draw_w)
            out.extend(self._step(now, name, members, dom, clocks_floor.get(name, False)))
        return out

    def domain_draw_w(self, name: str, dom: DomainStatus) -> float:
        """The domain's draw the rule decides on (W): its mean over the window (module
        docstring; the reading now when none is recorded)."""
        mean = self._draw.mean(_domain_key(name))
        return dom.draw_w if mean is None else mean

    def _mean_w(self, v: LimitView) -> float | None:
        """The backend's mean draw over the window (W; None: no reading)."""
        return self._draw.mean(_backend_key(v.backend_id))

    def _step(
        self, now: float, name: str, members: list[LimitView], dom: DomainStatus, floor: bool
    ) -> list[LimitChange]:
        cfg = self.cfg
        draw_w = self.domain_draw_w(name, dom)
        ratio = draw_w / dom.budget_w
        over = ratio >= cfg.domain_high_ratio
        if not (over and floor):
            self._floor_since.pop(name, None)
        elif name not in self._floor_since:
            self._floor_since[name] = now
        # under the low mark with every backend at its window's highest reading: a dip
        # of one reading (a GPU read between two engine steps) releases nothing
        settled_w = self._settled_w(members, draw_w)
        if settled_w >= cfg.domain_low_ratio * dom.budget_w:
            self._low_since.pop(name, None)
        elif name not in self._low_since:
            self._low_since[name] = now
        if now - self._domain_at.get(name, -1e18) < cfg.interval_s - _EPS:
            return []
        if over and floor and now - self._floor_since[name] >= cfg.interval_s - _EPS:
            share = self.share_w(members, draw_w, dom.budget_w)
            out = []
            for v in members:
                w = min(v.max_w, max(v.min_w, share))
                before = self._limits.get(v.backend_id)
                if before is None or w < before - _EPS:
                    self._limits[v.backend_id] = w
                    self._set_at.setdefault(v.backend_id, now)
                    if before is None:  # the window's highest draw at the clock floor
                        self._before_w[v.backend_id] = self._draw.peak(
                            _backend_key(v.backend_id), since=self._floor_since[name]
                        )
                    out.append(LimitChange(v.backend_id, w, before, "power"))
            if out:
                self._domain_at[name] = now
            return out
        stable_s = cfg.release_stable_intervals * cfg.interval_s
        if now - self._low_since.get(name, math.inf) >= stable_s - _EPS:
            # ... and it has stayed there release_stable_intervals rounds: a dip of the load
            # shorter than that (clients between two requests) releases nothing either
            high_w = cfg.domain_high_ratio * dom.budget_w
            held_since = now - cfg.min_hold_intervals * cfg.interval_s + _EPS
            limited = [
                v
                for v in members
                if v.backend_id in self._limits
                and self._set_at.get(v.backend_id, -math.inf) <= held_since
                and self._peak_w(v) < BINDING_SHARE * self._limits[v.backend_id] * v.gpus
                and self._after_release_w(v, settled_w) < high_w
            ]
            if not limited:
                return []
            v = min(limited, key=lambda v: (self._bound(v), v.backend_id))
            before = self._limits.pop(v.backend_id)
            self._set_at.pop(v.backend_id, None)
            self._before_w.pop(v.backend_id, None)
            self._domain_at[name] = now
            return [LimitChange(v.backend_id, None, before, "release")]
        return []

    def share_w(self, members: Sequence[LimitView], draw_w: float, budget_w: float) -> float:
        """Each controlled GPU's share of the domain's budget ``budget_w`` (W; module
        docstring): the target draw less the draw of the domain's uncontrolled GPUs (the
        domain's ``draw_w`` less the controlled backends' window means), over the
        controlled GPUs (not yet clamped to a GPU's range)."""
        controlled_w = sum(self._mean_w(v) or 0.0 for v in members)
        uncontrolled_w = max(0.0, draw_w - controlled_w)
        gpus = sum(v.gpus for v in members)
        target = self.cfg.power_limit_ratio * budget_w
        return max(0.0, target - uncontrolled_w) / max(1, gpus)

    def _peak_w(self, v: LimitView) -> float:
        """The backend's highest draw of the window (W; 0 without a reading)."""
        return self._draw.peak(_backend_key(v.backend_id)) or 0.0

    def _settled_w(self, members: Sequence[LimitView], draw_w: float) -> float:
        """The domain's draw (W) the release rule reads: the draw of its uncontrolled GPUs
        (the window mean ``draw_w`` less the members' means) plus each member's highest
        reading of the window."""
        means = sum(self._mean_w(v) or 0.0 for v in members)
        return max(0.0, draw_w - means) + sum(self._peak_w(v) for v in members)

    def _after_release_w(self, v: LimitView, settled_w: float) -> float:
        """The domain's draw (W; ``settled_w``: :meth:`_settled_w`) were ``v``'s limits
        cleared: the backend's draw back to the window maximum it had when they were set
        (unknown, e.g. an adopted limit: up to the limits)."""
        now_w = self._peak_w(v)
        before = self._before_w.get(v.backend_id)
        if before is None:
            before = self._limits[v.backend_id] * v.gpus
        return settled_w - now_w + max(now_w, before)

    def _bound(self, v: LimitView) -> float:
        """Mean draw over the backend's limits (1: the limits bind); 0 without a reading."""
        limit = self._limits.get(v.backend_id)
        mean = self._mean_w(v)
        if limit is None or mean is None or limit <= 0:
            return 0.0
        return mean / (limit * v.gpus)


def _domain_key(name: str) -> str:
    return "domain:" + name


def _backend_key(backend_id: str) -> str:
    return "backend:" + backend_id
