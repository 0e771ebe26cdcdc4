"""What one policy's fleet simulation reports (:class:`PolicyResult`, :class:`Series`), for
:func:`gateway.sim.fleet.simulate` (which re-exports both)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Series:
    """Sampled every ``record_every_s``: time (s), per domain its hottest GPU (°C) at that
    moment and its mean summed draw over the window (W)."""

    t: list[float] = field(default_factory=list)
    max_temp_c: dict[str, list[float]] = field(default_factory=dict)
    draw_w: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class PolicyResult:
    """One policy's run (units in the field names).

    ``rejected``: every request refused; of them ``rejected_power`` by the power layer
    (:func:`gateway.routing.thermal.power_pressure` over ``thermal.power_shed_levels``) and
    ``rejected_load`` by the resource layer (predicted queue wait over
    ``admission.shed_levels`` x ``slo.ttft_s``); the rest found no routable backend."""

    policy: str
    duration_s: float
    arrived: int
    completed: int
    rejected: int
    rejected_power: int
    rejected_load: int
    good: int
    goodput_rps: float
    slo_attainment: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    max_temp_c: float
    time_above_hot_s: float
    throttle_events: int
    throttle_time_s: float
    peak_domain_w: dict[str, float]
    peak_domain_instant_w: dict[str, float]
    domain_budget_w: dict[str, float]
    power_cap_events: int
    power_capped_s: float
    cooldowns: int
    cooldowns_completed: int
    clock_caps_set: int
    clock_caps_released: int
    energy_kwh: float
    output_tokens: int
    mean_utilisation: float
    max_temp_by_domain_c: dict[str, float]
    series: Series = field(default_factory=Series, repr=False)

    @property
    def peak_domain_power_w(self) -> float:
        """The highest mean draw over ``record_every_s`` (60 s) any domain reached (W)."""
        return max(self.peak_domain_w.values(), default=0.0)

    @property
    def served_slo_attainment(self) -> float:
        """Share (0-1) of the requests served to completion that met both SLOs (refused
        ones left out, unlike :attr:`slo_attainment`, which counts them as misses)."""
        return self.good / self.completed if self.completed else 1.0

    @property
    def energy_per_token_j(self) -> float:
        """GPU energy per output token of the requests completed (J/token): the whole run's
        GPU energy (idle included) over the output tokens of finished requests."""
        return self.energy_kwh * 3.6e6 / self.output_tokens if self.output_tokens else math.nan

    @property
    def peak_domain_instant_power_w(self) -> float:
        """The highest 1-s draw any domain reached (W); saturates at the domain's nameplate
        (GPUs x TDP) as soon as all its GPUs are busy at once for a second."""
        return max(self.peak_domain_instant_w.values(), default=0.0)

    def as_dict(self, with_series: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "series"}
        d["peak_domain_power_w"] = self.peak_domain_power_w
        d["peak_domain_instant_power_w"] = self.peak_domain_instant_power_w
        d["energy_per_token_j"] = self.energy_per_token_j
        d["served_slo_attainment"] = self.served_slo_attainment
        if with_series:
            s = self.series
            d["series"] = {"t": s.t, "max_temp_c": s.max_temp_c, "draw_w": s.draw_w}
        return d


def quantile(sorted_vals: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1, nearest rank) of ``sorted_vals``; NaN when empty."""
    if not sorted_vals:
        return math.nan
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]
