"""Presenting fleet-simulator results: a rich table, JSON, ratios, and a PNG (matplotlib).

Only formatting here; the numbers come from :func:`gateway.sim.fleet.simulate`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gateway.config import RoutingPolicy
from gateway.sim.fleet import CLOCKS, PolicyResult

TAPAS_REDUCTIONS: dict[str, float] = {
    "max_temp_c": 0.17,
    "peak_domain_power_w": 0.23,
    "throttle_events": 0.97,
    "power_cap_events": 0.99,
}
"""Reductions TAPAS reports against its baseline (Stojkovic et al., ASPLOS 2025,
arXiv:2501.02600): max temperature -17%, peak power -23%, thermal throttling -97%, power
throttling -99%."""

_ROWS: tuple[tuple[str, str, str], ...] = (
    ("max GPU temp (°C)", "max_temp_c", "{:.1f}"),
    ("GPU-time above hot (s)", "time_above_hot_s", "{:.0f}"),
    ("thermal-throttling events", "throttle_events", "{:d}"),
    ("throttled GPU-time (s)", "throttle_time_s", "{:.0f}"),
    ("peak domain power, 60-s mean (W)", "peak_domain_power_w", "{:.0f}"),
    ("peak domain power, 1-s (W)", "peak_domain_instant_power_w", "{:.0f}"),
    ("power-cap events", "power_cap_events", "{:d}"),
    ("goodput (req/s)", "goodput_rps", "{:.3f}"),
    ("SLO attainment", "slo_attainment", "{:.2%}"),
    ("SLO attainment of served", "served_slo_attainment", "{:.2%}"),
    ("TTFT P50 (s)", "ttft_p50_s", "{:.3f}"),
    ("TTFT P99 (s)", "ttft_p99_s", "{:.3f}"),
    ("mean ITL P50 (s)", "tpot_p50_s", "{:.4f}"),
    ("requests done / refused (power / load)", "_done_rejected", "{}"),
    ("cooldowns taken", "cooldowns", "{:d}"),
    ("energy (kWh)", "energy_kwh", "{:.1f}"),
    ("energy per output token (J)", "energy_per_token_j", "{:.3f}"),
)


def _value(r: PolicyResult, key: str) -> Any:
    if key == "_done_rejected":
        return f"{r.completed} / {r.rejected} ({r.rejected_power} / {r.rejected_load})"
    return getattr(r, key)


def results_table(results: Sequence[PolicyResult], title: str = "Fleet simulation") -> Table:
    """One column per policy, one row per measure (plus one row per domain's peak)."""
    t = Table(title=title)
    t.add_column("measure")
    for r in results:
        t.add_column(r.policy, justify="right")
    for label, key, fmt in _ROWS:
        t.add_row(label, *(fmt.format(_value(r, key)) for r in results))
    if results:
        for dom in results[0].peak_domain_w:
            budget = results[0].domain_budget_w.get(dom, math.nan)
            t.add_row(
                f"  peak {dom}, 60-s (W, budget {budget:.0f})",
                *(f"{r.peak_domain_w[dom]:.0f}" for r in results),
            )
            t.add_row(
                f"  max temp {dom} (°C)",
                *(f"{r.max_temp_by_domain_c[dom]:.1f}" for r in results),
            )
    return t


def _split(results: Sequence[PolicyResult]) -> tuple[list[PolicyResult], list[PolicyResult]]:
    """The runs of the gateway's own policies (``load_thermal``, whatever label follows, and
    ``clocks``) and the baselines."""
    own = (RoutingPolicy.LOAD_THERMAL.value, CLOCKS)
    gateway = [r for r in results if r.policy.startswith(own)]
    return gateway, [r for r in results if not r.policy.startswith(own)]


def reduction(value: float, base: float) -> float:
    """Relative reduction of ``value`` against ``base`` (0.25 = 25% lower); 0 when both are
    0, ``-inf`` when only the baseline is 0."""
    if base == 0:
        return 0.0 if value == 0 else -math.inf
    return 1.0 - value / base


def ratios(r: PolicyResult, base: PolicyResult) -> dict[str, float]:
    """Reductions of ``r`` against the baseline ``base`` for TAPAS's four measures and the
    energy per output token, plus the goodput ratio (``r`` over ``base``)."""
    out = {k: reduction(float(getattr(r, k)), float(getattr(base, k))) for k in TAPAS_REDUCTIONS}
    out["energy_per_token_j"] = reduction(r.energy_per_token_j, base.energy_per_token_j)
    out["goodput_ratio"] = r.goodput_rps / base.goodput_rps if base.goodput_rps else math.nan
    return out


def ratios_table(r: PolicyResult, bases: Sequence[PolicyResult]) -> Table:
    """Reductions of ``r`` against each baseline, next to TAPAS's figures."""
    t = Table(title=f"{r.policy}: reduction against each baseline (positive = better)")
    t.add_column("measure")
    for b in bases:
        t.add_column(f"vs {b.policy}", justify="right")
    t.add_column("TAPAS", justify="right")
    rs = [ratios(r, b) for b in bases]

    def cell(v: float) -> str:
        return f"{v:+.1%}" if math.isfinite(v) else "worse (base 0)"

    for key, tapas in TAPAS_REDUCTIONS.items():
        t.add_row(key, *(cell(r[key]) for r in rs), f"{tapas:+.0%}")
    t.add_row("energy per output token", *(cell(r["energy_per_token_j"]) for r in rs), "")
    t.add_row("goodput (policy / base)", *(f"{x['goodput_ratio']:.3f}" for x in rs), "")
    return t


def print_results(
    results: Sequence[PolicyResult], console: Console | None = None, title: str = ""
) -> None:
    """Print the table, and ratios of the gateway's policy against the baselines when both
    are present."""
    c = console or Console()
    c.print(results_table(results, title or "Fleet simulation"))
    gateway, bases = _split(results)
    for g in gateway:
        if bases:
            c.print(ratios_table(g, bases))


def to_json(results: Sequence[PolicyResult], with_series: bool = False, **extra: Any) -> str:
    """JSON of every result (and ``extra`` top-level fields, e.g. the scenario)."""
    body: dict[str, Any] = dict(extra)
    body["results"] = [r.as_dict(with_series) for r in results]
    gateway, bases = _split(results)
    body["ratios"] = {g.policy: {b.policy: ratios(g, b) for b in bases} for g in gateway}
    return json.dumps(body, indent=2, default=float)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, for the ``--plot`` flags. Raises
    ``RuntimeError`` with the install hint when matplotlib is missing (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'llm-gateway[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def write_plot(results: Sequence[PolicyResult], path: str | Path) -> Path:
    """A PNG of each domain's hottest GPU (°C) and draw (W) over time, one row per policy.

    Needs matplotlib (``pip install 'llm-gateway[plot]'``); raises ``RuntimeError`` with
    that hint when it is missing.
    """
    plt = pyplot()
    n = len(results)
    fig, axes = plt.subplots(n, 2, figsize=(13, 3.2 * n), squeeze=False, sharex=True)
    for row, r in enumerate(results):
        hours = [t / 3600.0 for t in r.series.t]
        ax_t, ax_p = axes[row]
        for dom, temps in r.series.max_temp_c.items():
            ax_t.plot(hours, temps, label=dom, linewidth=0.8)
        ax_t.axhline(85.0, color="red", linestyle="--", linewidth=0.7)
        ax_t.set_ylabel("hottest GPU (°C)")
        ax_t.set_title(f"{r.policy}: temperature")
        for dom, draws in r.series.draw_w.items():
            line = ax_p.plot(hours, draws, label=dom, linewidth=0.8)
            budget = r.domain_budget_w.get(dom)
            if budget:
                ax_p.axhline(budget, color=line[0].get_color(), linestyle=":", linewidth=0.7)
        ax_p.set_ylabel("domain draw (W)")
        ax_p.set_title(f"{r.policy}: power (dotted: budget)")
        ax_t.legend(fontsize=7, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("simulated hours")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
