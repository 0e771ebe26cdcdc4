"""``llm-gateway sim-fleet``: build a scenario from flags, run the policies, print/plot.

The main CLI wires it as::

    sp = sub.add_parser("sim-fleet", help="...")
    add_fleet_arguments(sp)
    sp.set_defaults(func=lambda a: run_fleet_from_args(a))

``benchmarks/thermal.py`` uses :func:`uneven_racks`, :func:`trace_for_load` and
:func:`run_policies` with its own 24-hour scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.console import Console

from gateway.config import ClockControlConfig, RoutingWeights, ThermalConfig
from gateway.core.wording import plural
from gateway.sim.fleet import (
    FLEET_ENGINE,
    POLICIES,
    SIM_POLICIES,
    FleetSpec,
    PolicyResult,
    RackSpec,
    capacity_rps,
    simulate,
)
from gateway.sim.fleet_report import print_results, to_json, write_plot
from gateway.sim.scaling_cli import (
    add_autoscale_arguments,
    finite_float,
    run_autoscale_from_args,
)
from gateway.sim.workload import Arrival, TraceSpec, generate, read_csv

FLEET_THERMAL = ThermalConfig(
    warm_penalty=0.15,
    unknown_penalty=0.6,
    predicted_weight=0.0,
    power_penalty=0.0,
    domain_penalty=1.0,
    domain_target_ratio=0.9,
    power_shed_levels=(1.0, 1.0, 1.0),
    clocks=ClockControlConfig(
        enabled=True, efficient_ratio=0.9, hot_margin_c=6.0, release_margin_c=9.0
    ),
)
"""The thermal settings the gateway's policy (``load_thermal``) runs with in the fleet simulator
(see README, "Fleet simulator"). Penalties are in load-score units; with :data:`FLEET_WEIGHTS`
one request running on a 32-slot backend scores 2/32 = 0.0625, so a warm backend (>= 75 °C, or
cool but predicted from its trend to reach ``hot_c`` within a minute) is avoided until the cooler
ones run about 2-3 more requests, and a domain above 90% of its budget until the others run 16
more; power admission sheds only once every candidate's domain is at its budget (the resource
layer, which sheds by predicted queue wait, runs with the gateway's defaults:
``FleetSpec.admission``). Hot backends (>= 85 °C) drain and rest as configured by default. The
``clocks`` policy's controller (issue 21): warm GPUs capped from 79 °C (``hot_margin_c`` 6),
released below 76 °C; an idle backend (no queue for 10 s) at 90% of its clock. Measured with
``python benchmarks/thermal.py [--seed N]`` (24 h) against least_request -- seed 1: peak domain
power -16.2%, max temperature -9.0%, energy per token -14.3%, no power-cap event, throttling or
refusal for power, 4,244 refused for load (the resource layer, in the bursts), goodput x1.0199
(every bar held; docs/architecture.md, "Clocks before shedding", has the other seeds). Before the
simulator modelled the resource layer (no refusal at all): seed 1 x0.9797 (the 0.98 bar missed by
0.0003), seed 2 x0.9825, seed 3 x0.9871; the frontiers and misses below are from then. Frontiers
on seed 1: over ``efficient_ratio``, 1.0 (off): goodput x0.980, energy -3.3%; 0.9: x0.9797,
-14.4%; 0.8: x0.972, -24.8%. Over ``domain_high_ratio`` (the share of the budget the power caps
hold; ``domain_low_ratio`` 0.1 below): 0.85: peak -16.3%, x0.9797; 0.90: -11.3%, x0.984; 0.95:
-5.3%, x0.988. The misses are TTFT queueing (over 98% waited more than the 2-s SLO before
admission) in the day's peak bursts (11:00-19:00), where every policy overloads the fleet;
least_request runs its racks at the facility cap (the budget), so 15% below it is about 3% less
capacity at a full batch (clock about 0.89: prefill ``1/f``). Why so light: at 70% load the cool
racks sit close to their power budgets, so every request steered off a warm GPU raises a cool
rack's draw; stronger steering (warm 0.6 and 0.02 per °C of predicted temperature above the
coolest were tried) gave more facility power caps and lower goodput in simulation, and the
gateway's defaults (8 for warm: eight *queued* requests; 0.1 per °C) pile queues on the cool
backends (``benchmarks/thermal.py --with-defaults`` shows by how much)."""

FLEET_WEIGHTS = RoutingWeights(waiting=1.0, running=2.0, kv_cache=0.1)
"""Load-score weights for the simulated fleet: with 32 slots and long requests the batch
slots, not KV tokens, bound each backend, so running requests weigh more than KV use."""

DEFAULT_AMBIENT_C = (22.0, 25.0, 28.0, 32.0)
"""Rack inlet temperatures (°C), best to worst: ASHRAE's recommended envelope is 18-27 °C,
its A1 allowable range up to 32 °C (a rack with hot-aisle recirculation)."""
DEFAULT_R_TH = (0.070, 0.075, 0.080, 0.085)
"""Thermal resistance (K/W), best to worst airflow; 0.075 puts an H100 at 700 W with 25 °C
inlet at 77.5 °C (:mod:`gateway.sim.thermal`)."""
DEFAULT_BUDGET_PER_GPU_W = 675.0
"""Domain budget per GPU (W): 96% of the 700 W TDP, a mildly oversubscribed rack."""


def _spread(values: Sequence[float], k: int, n: int) -> float:
    """Value for rack ``k`` of ``n``: the list itself when it has ``n`` entries, else a
    linear interpolation between its first and last."""
    if len(values) == n:
        return values[k]
    if n == 1 or len(values) == 1:
        return values[0]
    lo, hi = values[0], values[-1]
    return lo + (hi - lo) * k / (n - 1)


def uneven_racks(
    backends: int,
    racks: int,
    ambient_c: Sequence[float] = DEFAULT_AMBIENT_C,
    r_th: Sequence[float] = DEFAULT_R_TH,
    budget_per_gpu_w: float = DEFAULT_BUDGET_PER_GPU_W,
) -> tuple[RackSpec, ...]:
    """``backends`` spread over ``racks`` power domains, cooling from best to worst."""
    if racks < 1 or backends < racks:
        raise ValueError("need at least one rack and one backend per rack")
    out = []
    for k in range(racks):
        count = backends // racks + (1 if k < backends % racks else 0)
        out.append(
            RackSpec(
                name=f"rack-{chr(ord('a') + k)}",
                backends=count,
                ambient_c=_spread(ambient_c, k, racks),
                r_th_k_per_w=_spread(r_th, k, racks),
                budget_w=budget_per_gpu_w * count,
            )
        )
    return tuple(out)


def trace_for_load(
    spec: FleetSpec, load: float, duration_s: float, seed: int, **trace: Any
) -> TraceSpec:
    """A generated trace whose day-average offered load is ``load`` (0-1) of the fleet's
    capacity at full batches (:func:`gateway.sim.fleet.capacity_rps`), bursts included."""
    base = TraceSpec(duration_s=duration_s, seed=seed, **trace)
    cap = capacity_rps(spec.engine, base.prompt_mean, base.output_mean) * spec.num_backends
    return dataclasses.replace(base, mean_rps=load * cap / base.mean_burst_gain())


def run_policies(
    spec: FleetSpec,
    trace: Callable[[], Iterable[Arrival]],
    duration_s: float,
    policies: Sequence[str] = POLICIES,
    console: Console | None = None,
) -> list[PolicyResult]:
    """Run each policy on a fresh copy of the same trace; log progress to ``console``."""
    out = []
    for p in policies:
        t0 = time.perf_counter()
        r = simulate(spec, p, trace(), duration_s)
        if console is not None:
            console.log(
                f"{p}: {plural(r.arrived, 'request')} over {duration_s / 3600:.2f} simulated h "
                f"in {time.perf_counter() - t0:.1f} s"
            )
        out.append(r)
    return out


def _floats(text: str) -> list[float]:
    return [finite_float(x) for x in text.split(",") if x.strip()]


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``llm-gateway sim-fleet`` (seconds, °C, K/W, W, tokens)."""
    g = p.add_argument_group("fleet simulator")
    g.add_argument(
        "--backends",
        type=int,
        default=None,
        help="simulated backends (4; with --autoscale: the replicas the peak needs, 16)",
    )
    g.add_argument("--racks", type=int, default=2, help="power domains (default 2)")
    g.add_argument(
        "--duration",
        type=finite_float,
        default=None,
        help="simulated seconds (600, with --autoscale 86400; 0 with --trace: its last "
        "arrival + 1 s)",
    )
    g.add_argument(
        "--load",
        type=finite_float,
        default=None,
        help="average offered load 0-1 (0.7; with --autoscale a factor on the rate, 1)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    g.add_argument(
        "--start-hour",
        type=finite_float,
        default=None,
        help="time of day at t=0 (14; with --autoscale 10)",
    )
    g.add_argument("--trace", help="CSV of arrival_s,prompt_tokens,output_tokens instead")
    g.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(SIM_POLICIES)}"
    )
    g.add_argument(
        "--ambient",
        type=_floats,
        default=list(DEFAULT_AMBIENT_C),
        help="rack inlet temperatures, °C, best to worst (comma list)",
    )
    g.add_argument(
        "--r-th",
        type=_floats,
        default=list(DEFAULT_R_TH),
        help="rack thermal resistances, K/W (comma list)",
    )
    g.add_argument(
        "--budget-per-gpu",
        type=finite_float,
        default=DEFAULT_BUDGET_PER_GPU_W,
        help="power budget per GPU in its domain, W (675)",
    )
    g.add_argument(
        "--gateway-defaults",
        action="store_true",
        help="run load_thermal with the gateway's default thermal/routing settings",
    )
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g.add_argument(
        "--plot",
        metavar="PNG",
        help="write temperature/power (with --autoscale: replicas and load) over time",
    )
    add_autoscale_arguments(p)


def _routing_defaults(args: argparse.Namespace) -> None:
    """The routing comparison's defaults for the flags ``--autoscale`` reads otherwise."""
    for name, value in (("backends", 4), ("duration", 600.0), ("load", 0.7), ("start_hour", 14.0)):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def spec_from_args(args: argparse.Namespace) -> FleetSpec:
    racks = uneven_racks(args.backends, args.racks, args.ambient, args.r_th, args.budget_per_gpu)
    if args.gateway_defaults:
        return FleetSpec(racks=racks, engine=FLEET_ENGINE, seed=args.seed)
    return FleetSpec(
        racks=racks,
        engine=FLEET_ENGINE,
        thermal=FLEET_THERMAL,
        weights=FLEET_WEIGHTS,
        seed=args.seed,
    )


def run_fleet_from_args(args: argparse.Namespace) -> int:
    """Run ``sim-fleet``; returns the exit status."""
    if args.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "llm-gateway sim-fleet: --plot needs matplotlib: "
                "pip install 'llm-gateway[plot]' (or pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
    if getattr(args, "autoscale", None):
        return run_autoscale_from_args(args)
    _routing_defaults(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in SIM_POLICIES]
    if bad:
        print(f"llm-gateway sim-fleet: unknown policy {bad[0]!r}", file=sys.stderr)
        return 2
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"llm-gateway sim-fleet: {e}", file=sys.stderr)
        return 2
    duration = args.duration
    if args.trace:
        try:
            rows = read_csv(args.trace)
        except (OSError, ValueError) as e:
            print(f"llm-gateway sim-fleet: {e}", file=sys.stderr)
            return 2
        if rows and args.duration <= 0:
            duration = rows[-1].t + 1.0

        def trace() -> Iterable[Arrival]:
            return rows

    else:
        ts = trace_for_load(spec, args.load, duration, args.seed, start_hour=args.start_hour)

        def trace() -> Iterable[Arrival]:
            return generate(ts)

    console = Console(stderr=True) if args.json else Console()
    results = run_policies(spec, trace, duration, policies, console=Console(stderr=True))
    if args.json:
        print(
            to_json(
                results,
                scenario={
                    "backends": args.backends,
                    "racks": args.racks,
                    "duration_s": duration,
                    "load": args.load,
                    "seed": args.seed,
                },
            )
        )
    else:
        print_results(
            results,
            console,
            title=f"sim-fleet: {plural(args.backends, 'backend')}, "
            f"{plural(args.racks, 'rack')}, {duration:.0f} s, load {args.load}",
        )
    if args.plot:
        write_plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m gateway.sim.fleet_cli --backends 8``."""
    p = argparse.ArgumentParser(
        description="Simulated GPU fleet: routing (or, with --autoscale, autoscaling) "
        "policies compared"
    )
    add_fleet_arguments(p)
    return run_fleet_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
