"""Presenting autoscaling runs (:func:`gateway.sim.scaling.simulate_scaling`): a rich table,
JSON, and a PNG of replicas and load over the run (matplotlib). Only formatting here."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from gateway.sim.fleet_report import pyplot
from gateway.sim.scaling import ScalingResult


def _fmt(v: float | None, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v)


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("L: scale-up lag P50 (s)", "lag_p50_s", "{:.0f}"),
    ("W: idle GPU share", "idle_share", "{:.1%}"),
    ("batch slots used", "slot_share", "{:.1%}"),
    ("S: SLO attainment", "slo_attainment", "{:.2%}"),
    ("C: USD per 1M output tokens", "cost_per_mtok_usd", "{:.3f}"),
    ("GPU-hours", "gpu_hours", "{:.1f}"),
    ("replicas mean", "mean_replicas", "{:.2f}"),
    ("replicas max", "max_replicas", "{:d}"),
    ("replicas asked for", "replicas_asked", "{:d}"),
    ("TTFT P50 (s)", "ttft_p50_s", "{:.2f}"),
    ("TTFT P99 (s)", "ttft_p99_s", "{:.2f}"),
    ("requests arrived", "arrived", "{:d}"),
    ("requests rejected", "rejected", "{:d}"),
)


def results_table(results: Sequence[ScalingResult], title: str = "Autoscaling") -> Table:
    """One column per policy, one row per measure."""
    t = Table(title=title)
    t.add_column("measure")
    for r in results:
        t.add_column(r.policy, justify="right")
    for label, key, fmt in _ROWS:
        t.add_row(label, *(_fmt(getattr(r, key), fmt) for r in results))
    return t


def to_json(results: Sequence[ScalingResult], with_series: bool = False, **extra: Any) -> str:
    """JSON of every result (``results``, each with ``L``, ``W``, ``S``, ``C``) and the
    ``extra`` top-level fields (the scenario)."""
    body: dict[str, Any] = dict(extra)
    body["results"] = [r.as_dict(with_series) for r in results]
    return json.dumps(body, indent=2)


def write_plot(results: Sequence[ScalingResult], path: str | Path) -> Path:
    """A PNG, one panel per policy: replicas allocated, ready and desired (left axis) and
    the arrival rate (right axis) over the run's hours. Needs matplotlib (``pip install
    'llm-gateway[plot]'``); raises ``RuntimeError`` with that hint when it is missing."""
    plt = pyplot()
    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(12, 2.6 * n), squeeze=False, sharex=True)
    for row, r in enumerate(results):
        ax = axes[row][0]
        s = r.series
        hours = [t / 3600.0 for t in s.t]
        ax.step(hours, s.allocated, where="post", label="allocated", linewidth=1.0)
        ax.step(hours, s.ready, where="post", label="ready", linewidth=0.8)
        ax.step(hours, s.desired, where="post", label="desired", linewidth=0.6, linestyle=":")
        ax.set_ylabel("replicas")
        ax.set_ylim(bottom=0)  # a static fleet's flat line, not a zoom onto it
        ax.set_title(
            f"{r.policy}: S {r.slo_attainment:.1%}, {r.gpu_hours:.0f} GPU-h, W {r.idle_share:.1%}"
        )
        load = ax.twinx()
        load.plot(hours, s.arrival_rps, color="grey", linewidth=0.6, alpha=0.7, label="arrivals")
        load.set_ylabel("requests/s")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1][0].set_xlabel("simulated hours")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
