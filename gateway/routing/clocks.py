"""Clocks before shedding (issue 21): SM clock caps per power domain and per hot GPU (pure).

When a power domain nears its budget, the gateway lowers the SM clocks of its GPUs step by
step before it refuses any request for power; a GPU in the warm tier gets a clock cap that
keeps it under ``hot_c`` instead of being drained. Why clocks first: LLM decode is bound by
HBM bandwidth and barely slows at a lower SM clock, while the GPU's draw falls about as
``f^3`` near the top of its DVFS range (Maliakel et al., arXiv:2501.08219: about 42% less
energy for 1-6% more latency; DynamoLLM, Stojkovic et al., HPCA 2025: 53% energy saved at
the service level under SLOs; GreenLLM, Liu et al., arXiv:2508.16449: prefill, which is
compute-bound, is the phase a low clock slows).

:class:`ClockController` holds three caps per backend, as shares of the GPU's maximum SM
clock, and applies the lowest, never below ``floor_ratio``
(:class:`gateway.config.ClockControlConfig` names every threshold):

* **power** (per domain, one step per ``interval_s``): draw over ``domain_high_ratio`` of the
  budget lowers GPUs by ``step_ratio`` -- the most decode-heavy first (its share of
  running requests among running + waiting: a backend with no queue is decoding, and a
  lower clock slows decode least), the hottest on a tie; how many in proportion to how far
  the draw is from the high mark to the budget (one just above the mark, every GPU of the
  domain at or over the budget). Below ``domain_low_ratio`` one capped GPU steps back up,
  the most prefill-heavy first. Between the two (hysteresis both ways) only a capped GPU
  with requests *waiting* steps up -- the most prefill-heavy, one per step -- and only while
  the domain's draw plus that step's rise stays under the high mark: the rise is bounded by
  the GPU's draw times ``((f + step) / f)^3 - 1`` (dynamic power ``C V^2 f`` with ``V``
  following ``f`` at the top of the DVFS range; the static and memory shares do not rise, so
  the real rise is lower). A queue is prefill to come, which a capped clock slows as
  ``1/f`` (GreenLLM), so the headroom the band leaves goes to the GPUs that need clock.
* **thermal** (per GPU, one step per ``interval_s``): from ``hot_c - hot_margin_c`` the cap
  steps down, below ``hot_c - release_margin_c`` it steps back up.
* **efficiency**: a backend with no request waiting for ``efficient_after_s`` runs at
  ``efficient_ratio`` (DynamoLLM's rule: the lowest clock that still meets the SLO); the cap
  lifts as soon as requests wait -- in a domain over ``domain_low_ratio`` by handing the
  clock to the power cap, which then rises a step at a time (a burst lifting every
  efficiency cap at once would jump the domain's draw over its budget).

:meth:`ClockController.exhausted` says whether every GPU of a domain is at the floor: only
then are its GPUs' power limits set (:mod:`gateway.routing.power_limits`), and only once
those are set too may power shedding start. :class:`PowerShedGate` adds the hysteresis
power shedding lacked: once on, a class is shed until the draw falls ``power_shed_release``
below its level.

**Smoothed draw** (issue 21): the power steps read the domain's draw over a window of
``smooth_intervals x interval_s`` (:class:`gateway.routing.draw_window.DrawWindow`), not
one sample: down on the window's mean over the high mark; up (below the low mark, or the
band's step) only on the window's highest reading, so one low sample moves no clock up.

Everything takes time and readings as arguments (seconds, °C, W); no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.config import ClockControlConfig
from gateway.routing.draw_window import DrawWindow
from gateway.routing.thermal import DomainStatus

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class GpuView:
    """What the controller reads of one backend: its power domain, its GPUs' maximum SM
    clock (MHz), its hottest GPU's temperature (°C; None: no fresh sample), its queue
    (vLLM ``num_requests_running`` / ``num_requests_waiting``) and its GPUs' draw (W)."""

    backend_id: str
    domain: str | None
    max_mhz: float
    temp_c: float | None
    running: float
    waiting: float
    power_w: float | None = None  # its GPUs' draw now (W); None: unknown (no band release)

    @property
    def decode_share(self) -> float:
        """Running over running + waiting (1 when idle): how decode-heavy its work is now."""
        total = self.running + self.waiting
        return self.running / total if total > 0 else 1.0


@dataclass(frozen=True, slots=True)
class CapChange:
    """One cap set or released: ``max_mhz`` None means released (full clock). ``reason``:
    ``power``, ``thermal``, ``efficiency`` or ``release`` (the cap that binds now)."""

    backend_id: str
    max_mhz: float | None
    previous_mhz: float | None
    reason: str


@dataclass(slots=True)
class _Caps:
    power: float = 1.0
    thermal: float = 1.0
    efficiency: float = 1.0
    applied: float = 1.0
    thermal_at: float = -1e18
    queue_at: float = -1e18  # last time requests were seen waiting


class ClockController:
    """The clock caps of every backend (see the module docstring). Call :meth:`decide` once
    per GPU telemetry round; apply the :class:`CapChange` list it returns."""

    def __init__(self, cfg: ClockControlConfig, hot_c: float) -> None:
        self.cfg = cfg
        self.hot_c = hot_c
        self._caps: dict[str, _Caps] = {}
        self._domain_at: dict[str, float] = {}
        self._max_mhz: dict[str, float] = {}
        # each domain's draw over smooth_intervals x interval_s (W; module docstring)
        self._draw = DrawWindow(cfg.smooth_intervals * cfg.interval_s)

    def share(self, backend_id: str) -> float:
        """The cap applied to ``backend_id`` now (share of its max SM clock; 1: none)."""
        c = self._caps.get(backend_id)
        return 1.0 if c is None else c.applied

    def cap_mhz(self, backend_id: str) -> float | None:
        """The cap applied to ``backend_id`` now (MHz), None when it runs uncapped."""
        c = self._caps.get(backend_id)
        if c is None or c.applied >= 1.0 - _EPS:
            return None
        return c.applied * self._max_mhz[backend_id]

    def caps(self) -> dict[str, float]:
        """Every backend's applied cap (share), capped or not."""
        return {b: c.applied for b, c in self._caps.items()}

    def exhausted(self, domain: str, members: Iterable[str]) -> bool:
        """Whether every GPU of ``domain`` (its backends ``members``) is capped at the floor:
        only then may power shedding start."""
        del domain  # named for the caller's reading; the members are what count
        floor = self.cfg.floor_ratio + _EPS
        return all(self.share(b) <= floor for b in members)

    def forget(self, backend_id: str) -> None:
        """Drop a backend that left the fleet."""
        self._caps.pop(backend_id, None)
        self._max_mhz.pop(backend_id, None)

    def adopt(self, backend_id: str, share: float, max_mhz: float) -> None:
        """A cap found on ``backend_id``'s GPUs (``share`` of ``max_mhz``) when this
        controller starts to drive them (another gateway replica set it): kept as its power
        cap, so the next step moves on from it instead of jumping back to full clock."""
        share = min(1.0, max(self.cfg.floor_ratio, share))
        self._max_mhz[backend_id] = max_mhz
        self._caps[backend_id] = _Caps(power=share, applied=share)

    def decide(
        self,
        now: float,
        gpus: Sequence[GpuView],
        domains: Mapping[str, DomainStatus],
        hold: Collection[str] = (),
    ) -> list[CapChange]:
        """One control step at ``now`` (seconds): update the caps from ``gpus`` and the
        domains' draw and budget; return the caps that changed. ``hold``: domains whose
        power caps must not step up now (their GPUs' power limits are still set:
        :meth:`gateway.routing.power_limits.PowerLimitController.holding`)."""
        cfg = self.cfg
        seen = {g.domain for g in gpus if g.domain is not None}
        for name in sorted(seen):
            dom = domains.get(name)
            if dom is not None and dom.budget_w > 0:
                self._draw.add(name, now, dom.draw_w)
        for g in gpus:
            self._max_mhz[g.backend_id] = g.max_mhz
            c = self._caps.setdefault(g.backend_id, _Caps())
            if g.waiting > 0:
                c.queue_at = now
            idle_s = now - c.queue_at
            idle = g.waiting <= 0 and idle_s >= cfg.efficient_after_s
            lifted = not idle and c.efficiency < 1.0
            c.efficiency = cfg.efficient_ratio if idle else 1.0
            dom = domains.get(g.domain) if g.domain is not None else None
            if lifted and dom is not None and dom.budget_w > 0:
                if self._mean_w(dom.name, dom.draw_w) / dom.budget_w >= cfg.domain_low_ratio:
                    # a domain with little headroom: the power cap takes over the clock,
                    # so the lift comes a step at a time and a burst cannot jump the draw
                    c.power = min(c.power, c.applied)
            self._thermal_step(now, g, c)
        by_domain: dict[str, list[GpuView]] = {}
        for g in gpus:
            if g.domain is not None:
                by_domain.setdefault(g.domain, []).append(g)
        for name, members in by_domain.items():
            dom = domains.get(name)
            if dom is not None and dom.budget_w > 0:
                peak_w = self._draw.peak(name)
                high_w = dom.draw_w if peak_w is None else peak_w
                if name in hold and high_w < cfg.domain_low_ratio * dom.budget_w:
                    continue  # the power limits are released first
                mean_w = self._mean_w(name, dom.draw_w)
                self._power_step(now, name, members, mean_w, high_w, dom.budget_w)
        return self._apply(gpus)

    def _mean_w(self, name: str, draw_w: float) -> float:
        """The domain's mean draw over the window (W; ``draw_w``, the reading, without)."""
        mean = self._draw.mean(name)
        return draw_w if mean is None else mean

    # -- the three caps
    def _thermal_step(self, now: float, g: GpuView, c: _Caps) -> None:
        cfg = self.cfg
        if g.temp_c is None or now - c.thermal_at < cfg.interval_s - _EPS:
            return
        if g.temp_c >= self.hot_c - cfg.hot_margin_c:
            base = min(c.thermal, c.applied)
            c.thermal = max(cfg.floor_ratio, base - cfg.step_ratio)
            c.thermal_at = now
        elif g.temp_c < self.hot_c - cfg.release_margin_c and c.thermal < 1.0:
            c.thermal = min(1.0, c.thermal + cfg.step_ratio)
            c.thermal_at = now

    def _power_step(
        self,
        now: float,
        name: str,
        members: list[GpuView],
        draw_w: float,
        peak_w: float,
        budget_w: float,
    ) -> None:
        """One power step of domain ``name``: ``draw_w`` is its mean draw over the window,
        ``peak_w`` its highest reading there (W): down on the mean over the high mark, up
        only when even the highest reading is under the low mark (or, in the band, leaves
        room under the high mark)."""
        cfg = self.cfg
        if now - self._domain_at.get(name, -1e18) < cfg.interval_s - _EPS:
            return
        caps = self._caps
        ratio = draw_w / budget_w
        if ratio >= cfg.domain_high_ratio:
            movable = [g for g in members if caps[g.backend_id].applied > cfg.floor_ratio + _EPS]
            if not movable:
                return
            movable.sort(key=lambda g: (-g.decode_share, -(g.temp_c or 0.0), g.backend_id))
            share = (ratio - cfg.domain_high_ratio) / max(_EPS, 1.0 - cfg.domain_high_ratio)
            k = max(1, math.ceil(min(1.0, share) * len(members)))
            chosen = movable[:k]
            for g in chosen:
                c = caps[g.backend_id]
                c.power = max(cfg.floor_ratio, min(c.power, c.applied) - cfg.step_ratio)
            self._domain_at[name] = now
        elif peak_w < cfg.domain_low_ratio * budget_w:
            capped = [g for g in members if caps[g.backend_id].power < 1.0]
            if not capped:
                return
            g = min(capped, key=lambda g: (g.decode_share, g.temp_c or 0.0, g.backend_id))
            c = caps[g.backend_id]
            c.power = min(1.0, c.power + cfg.step_ratio)
            self._domain_at[name] = now
        elif ratio < cfg.domain_high_ratio:
            self._band_release(now, name, members, peak_w, budget_w)

    def _band_release(
        self, now: float, name: str, members: list[GpuView], draw_w: float, budget_w: float
    ) -> None:
        """Inside the band: step up the most prefill-heavy power-capped GPU with requests
        waiting, if its rise (bounded as in the module docstring) keeps the domain (``draw_w``:
        its highest reading of the window) under the high mark."""
        cfg = self.cfg
        queued = [
            g
            for g in members
            if g.waiting > 0
            and g.power_w is not None
            and self._caps[g.backend_id].power < min(1.0, self._caps[g.backend_id].thermal)
        ]
        if not queued:
            return
        g = min(queued, key=lambda g: (g.decode_share, g.temp_c or 0.0, g.backend_id))
        c = self._caps[g.backend_id]
        f = max(_EPS, c.applied)
        up = min(1.0, c.power + cfg.step_ratio)
        assert g.power_w is not None
        rise = g.power_w * ((max(f, up) / f) ** 3 - 1.0)
        if draw_w + rise < cfg.domain_high_ratio * budget_w:
            c.power = up
            self._domain_at[name] = now

    def _apply(self, gpus: Sequence[GpuView]) -> list[CapChange]:
        out: list[CapChange] = []
        for g in gpus:
            c = self._caps[g.backend_id]
            want = min(c.power, c.thermal, c.efficiency)
            new = max(self.cfg.floor_ratio, want) if want < 1.0 else 1.0
            if abs(new - c.applied) <= _EPS:
                continue
            prev = None if c.applied >= 1.0 - _EPS else c.applied * g.max_mhz
            c.applied = new
            if new >= 1.0 - _EPS:
                reason, mhz = "release", None
            else:
                mhz = new * g.max_mhz
                reason = min(
                    (c.power, "power"), (c.thermal, "thermal"), (c.efficiency, "efficiency")
                )[1]
            out.append(CapChange(g.backend_id, mhz, prev, reason))
        return out


class PowerShedGate:
    """Power shedding with hysteresis: the saturation level admission sheds on
    (:func:`gateway.traffic.admission.shed` with ``thermal.power_shed_levels``).

    Off, the level is 0 until the draw / budget reaches the lowest shedding level with the
    domains' clocks exhausted (:meth:`ClockController.exhausted`); on, the level is the
    pressure plus ``release`` (so each class stays shed until the draw falls ``release``
    below its level), and it turns off once that sum falls under the lowest level."""

    def __init__(self, levels: tuple[float, float, float], release: float) -> None:
        self.lowest = min(levels)
        self.release = release
        self.active = False

    def level(self, pressure: float, exhausted: bool) -> float:
        """The saturation level to shed on at ``pressure`` (draw / budget)."""
        if not self.active:
            if pressure >= self.lowest and exhausted:
                self.active = True
            else:
                return 0.0
        if pressure + self.release < self.lowest:
            self.active = False
            return 0.0
        return pressure + self.release
