"""``llm-gateway sim-fleet --autoscale POLICY[,POLICY...]``: the autoscaling comparison
(:mod:`gateway.sim.scaling`) instead of the routing one, its flags and its run.

:func:`add_autoscale_arguments` adds the flags to ``sim-fleet``'s parser;
:func:`run_autoscale_from_args` runs when ``--autoscale`` is given. The shared flags mean,
with ``--autoscale``: ``--backends`` the replicas the trace's peak needs at a full batch
(default 16: the rate is ``load x backends x capacity / (peak diurnal x peak burst)``),
``--load`` a factor on that rate (default 1), ``--duration`` default 86,400 s (a day),
``--start-hour`` default 10.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from rich.console import Console

from gateway.config import AutoscaleConfig
from gateway.sim.scaling import (
    DEFAULT_GPU_HOUR_USD,
    ScalingResult,
    ScalingSpec,
    replica_capacity_rps,
    run_policies,
)
from gateway.sim.scaling_policies import POLICY_NAMES, ScalingPolicy, build_policy
from gateway.sim.scaling_report import results_table, to_json, write_plot
from gateway.sim.workload import TraceSpec

AUTOSCALE_DURATION_S = 86_400.0
AUTOSCALE_PEAK_REPLICAS = 16


def finite_float(text: str) -> float:
    """An argparse ``type`` for a float flag: a finite number, else
    :class:`argparse.ArgumentTypeError` (exit 2 with the flag named). ``float()`` alone takes
    ``nan`` and ``inf``, and a simulated duration or rate of either never ends."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"need a finite number, got {text!r}")
    return v


def parse_policies(text: str) -> list[str]:
    """``POLICY[,POLICY...]`` or ``all`` -> names; ValueError naming the unknown one, or
    one given twice (its run would be repeated as a second, identical column)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(POLICY_NAMES)
    twice = [p for i, p in enumerate(names) if p in names[:i]]
    if twice:
        raise ValueError(f"autoscaling policy {twice[0]!r} given twice")
    bad = [p for p in names if p not in POLICY_NAMES]
    if bad or not names:
        raise ValueError(
            f"unknown autoscaling policy {bad[0] if bad else text!r} "
            f"(one of {', '.join(POLICY_NAMES)}, or all)"
        )
    return names


def parse_cold_start(text: str) -> tuple[float, float]:
    """``MIN,MAX`` seconds -> ``(min, max)``; ValueError unless ``0 <= MIN <= MAX``."""
    try:
        lo, hi = (finite_float(x) for x in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"--cold-start wants MIN,MAX seconds, got {text!r}") from None
    if not 0 <= lo <= hi:
        raise ValueError(f"--cold-start needs 0 <= MIN <= MAX seconds, got {text!r}")
    return lo, hi


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    """The autoscaling flags of ``sim-fleet`` (seconds, USD, days)."""
    g = p.add_argument_group("autoscaling (with --autoscale)")
    g.add_argument(
        "--autoscale",
        metavar="POLICY[,POLICY...]",
        help=f"compare autoscaling policies instead of routing: {', '.join(POLICY_NAMES)}, or all",
    )
    g.add_argument(
        "--cold-start",
        default="60,90",
        metavar="MIN,MAX",
        help="a replica's cold start, uniform in [MIN, MAX] seconds (60,90)",
    )
    g.add_argument(
        "--gpu-hour-usd",
        type=finite_float,
        default=DEFAULT_GPU_HOUR_USD,
        help=f"price of one GPU-hour, USD ({DEFAULT_GPU_HOUR_USD:.2f})",
    )
    g.add_argument(
        "--history-days",
        type=int,
        default=3,
        help="days of the same traffic the forecaster saw before the run (3)",
    )


def autoscale_trace(
    peak_replicas: int, load: float, duration_s: float, seed: int, start_hour: float
) -> TraceSpec:
    """The default trace kind (:class:`TraceSpec` defaults: diurnal +-35%, about one burst
    an hour of x1.2-1.5) at the rate whose peak (diurnal peak x the largest burst) needs
    ``peak_replicas`` replicas at a full batch, times ``load``."""
    base = TraceSpec(duration_s=duration_s, seed=seed, start_hour=start_hour)
    cap = replica_capacity_rps(ScalingSpec(), base)
    peak_gain = (1 + base.diurnal_amplitude) * base.burst_factor[1]
    return dataclasses.replace(base, mean_rps=load * peak_replicas * cap / peak_gain)


def build_policies(
    names: list[str], spec: ScalingSpec, keda_threshold: float = 5.0
) -> list[ScalingPolicy]:
    """Fresh policies by name for ``spec``."""
    return [
        build_policy(n, spec.autoscale, spec.slo.ttft_s, keda_threshold=keda_threshold)
        for n in names
    ]


def run_autoscale_from_args(args: argparse.Namespace) -> int:
    """Run ``sim-fleet --autoscale``; returns the exit status."""
    err = Console(stderr=True)
    try:
        names = parse_policies(args.autoscale)
        cold_start = parse_cold_start(args.cold_start)
    except ValueError as e:
        print(f"llm-gateway sim-fleet: {e}", file=sys.stderr)
        return 2
    if args.trace:
        print(
            "llm-gateway sim-fleet: --autoscale runs a generated trace (no --trace)",
            file=sys.stderr,
        )
        return 2
    if args.history_days < 0 or args.gpu_hour_usd < 0:
        print(
            "llm-gateway sim-fleet: --history-days and --gpu-hour-usd must be >= 0", file=sys.stderr
        )
        return 2
    duration = AUTOSCALE_DURATION_S if args.duration is None else args.duration
    peak = AUTOSCALE_PEAK_REPLICAS if args.backends is None else args.backends
    load = 1.0 if args.load is None else args.load
    hour = 10.0 if args.start_hour is None else args.start_hour
    if duration <= 0 or peak < 1 or load <= 0:
        print(
            "llm-gateway sim-fleet: need --duration > 0, --backends >= 1, --load > 0",
            file=sys.stderr,
        )
        return 2
    spec = ScalingSpec(
        autoscale=AutoscaleConfig(),
        cold_start_s=cold_start,
        gpu_hour_usd=args.gpu_hour_usd,
        history_days=args.history_days,
        seed=args.seed,
    )
    trace = autoscale_trace(peak, load, duration, args.seed, hour)

    def progress(name: str, r: ScalingResult, took: float) -> None:
        err.log(
            f"{name}: {r.arrived} requests over {duration / 3600:.2f} simulated h in {took:.1f} s"
        )

    results = run_policies(spec, trace, build_policies(names, spec), progress)
    scenario: dict[str, Any] = {
        "duration_s": duration,
        "peak_replicas": peak,
        "load": load,
        "mean_rps": trace.mean_rps,
        "seed": args.seed,
        "cold_start_s": list(cold_start),
        "gpu_hour_usd": args.gpu_hour_usd,
        "history_days": args.history_days,
    }
    if args.json:
        print(to_json(results, scenario=scenario))
    else:
        Console().print(
            results_table(
                results, f"sim-fleet --autoscale: {duration / 3600:.2f} h, peak {peak} replicas"
            )
        )
    if args.plot:
        write_plot(results, args.plot)
        err.print(f"wrote {args.plot}")
    return 0
