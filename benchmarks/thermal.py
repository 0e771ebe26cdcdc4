"""Thermal/power benchmark (issue 5): a simulated day of 16 GPUs in 4 unevenly cooled racks.

Scenario (all in simulated time, :mod:`gateway.sim.fleet`; about 2-4 minutes on one core):

* 16 backends, each one H100 SXM (700 W TDP) serving a 70B-class FP8 model
  (:data:`gateway.sim.fleet.FLEET_ENGINE`, 32 batch slots), in 4 racks = power domains of
  4 GPUs with a budget of 4 x 675 W = 2,700 W each and uneven cooling: inlet 22 / 25 / 28 /
  32 °C and thermal resistance 0.070 / 0.075 / 0.080 / 0.085 K/W (rack-a best, rack-d worst;
  :mod:`gateway.sim.thermal` documents the physics and where the constants come from).
* A 24-hour trace from ``--seed``: Poisson arrivals whose rate follows a day (trough 04:00,
  peak 16:00, +/-30%) with bursts (about one an hour, 2-10 minutes, x1.2-1.5), long-form
  requests (log-normal, mean 2,000 prompt / 800 output tokens), at ``--load`` (0.7) of the
  fleet's full-batch capacity on average.
* Policies: ``round_robin``, ``least_request`` (fewest in flight), ``load_thermal``
  (the gateway's own routing/thermal/admission/lifecycle code with :data:`FLEET_THERMAL`
  and :data:`FLEET_WEIGHTS`) and ``clocks`` (issue 21: ``load_thermal`` plus the clock
  controller, :mod:`gateway.routing.clocks`, with ``FLEET_THERMAL.clocks``: caps of SM
  clocks before shedding and instead of cooldowns); with ``--with-defaults`` also
  ``load_thermal (gateway defaults)``. Same trace and physics for all.

Prints the table and the reductions of load_thermal against each baseline next to TAPAS's
(max temperature -17%, peak power -23%, thermal throttling -97%, power throttling -99%),
checks issue 5's "must hold" against least_request (>= 97% fewer throttling events, lower
max temperature and peak domain power, goodput within 2%) and issue 21's for ``clocks``
(:func:`clocks_bars`) and says which held. Energy per output token is the run's GPU energy
over the output tokens of the requests completed. Writes
``benchmarks/results/thermal.json`` (and ``--plot PNG``).

Exit status: 0 when every check holds; 1 when an issue-21 bar fails (the gateway's answer to
power and heat today: clocks first); 2 when only issue 5's checks fail. Issue 5's bars are
on ``load_thermal``, routing alone, and one of them cannot hold under the DVFS physics:
when every rack is full at once (the day's peak bursts), both ``load_thermal`` and
``least_request`` reach their domains' budgets, the facility caps them there (a domain
over its budget for one second is held to it for ``facility_cap_hold_s``), and the
highest 60-s mean of both is the budget plus the second that tripped the cap -- equal, so
"lower peak domain power" fails. The benchmark prints that diagnosis when it is the
reason, and keeps the bar (a distinct status, not a pass).

Run: ``python benchmarks/thermal.py`` (``--hours 1`` for a quick look).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.sim.fleet import CLOCKS, FLEET_ENGINE, FleetSpec, PolicyResult, simulate
from gateway.sim.fleet_cli import (
    FLEET_THERMAL,
    FLEET_WEIGHTS,
    trace_for_load,
    uneven_racks,
)
from gateway.sim.fleet_report import print_results, ratios, reduction, to_json, write_plot
from gateway.sim.workload import generate

RESULTS = Path(__file__).resolve().parent / "results" / "thermal.json"

TODAY_POWER_REFUSALS = 9442
"""Requests ``load_thermal`` refused for power on the default 24-h trace (seed 1) when issue
21 was filed, under the simulator's physics of then (issue 21)."""


def clocks_bars(ck: PolicyResult, lr: PolicyResult, lt: PolicyResult) -> dict[str, bool]:
    """Issue 21's "must hold" for ``clocks`` (``ck``) against least_request (``lr``);
    requests refused for power against the gateway's policy without clocks (``lt``, this
    run) -- a tenth of its power refusals at most (refusals for load, the resource layer's
    predicted queue wait, are not power refusals and count only through goodput)."""
    return {
        ">= 15% lower peak domain power (60-s mean)": reduction(
            ck.peak_domain_power_w, lr.peak_domain_power_w
        )
        >= 0.15,
        ">= 8% lower max GPU temperature": reduction(ck.max_temp_c, lr.max_temp_c) >= 0.08,
        ">= 97% fewer power-cap events": ck.power_cap_events <= 0.03 * lr.power_cap_events,
        ">= 97% fewer throttling events": ck.throttle_events <= 0.03 * lr.throttle_events,
        "goodput >= 0.98x": ck.goodput_rps >= 0.98 * lr.goodput_rps,
        ">= 10% lower energy per output token": reduction(
            ck.energy_per_token_j, lr.energy_per_token_j
        )
        >= 0.10,
        "refused for power <= a tenth of load_thermal's": (
            ck.rejected_power <= 0.1 * lt.rejected_power
        ),
    }


def at_facility_cap(r: PolicyResult) -> list[str]:
    """The domains whose highest 60-s mean draw reached their budget in run ``r`` (the
    facility's cap then holds them there, so that mean cannot rise much above it)."""
    return [d for d, w in r.peak_domain_w.items() if w >= r.domain_budget_w[d] - 1.0]


def peak_diagnosis(gw: PolicyResult, lr: PolicyResult) -> str:
    """Why ``gw`` (load_thermal) has no lower peak domain power than ``lr``, in words."""
    gd, ld = at_facility_cap(gw), at_facility_cap(lr)
    head = f"{gw.policy} {gw.peak_domain_power_w:.0f} W, {lr.policy} {lr.peak_domain_power_w:.0f} W"
    if gd and ld:
        return (
            f"{head}: both reach the facility cap (budget {max(gw.domain_budget_w.values()):.0f}"
            f" W) in {', '.join(gd)} / {', '.join(ld)} ({gw.power_cap_events} / "
            f"{lr.power_cap_events} power-cap events), so both peaks are the budget plus the "
            "second that tripped the cap: routing alone cannot lower a peak every rack reaches "
            "at once (clock caps can: issue 21)"
        )
    return f"{head}: not at the facility cap; the routing itself does not lower the peak"


def _none_either_way(check: str, r: PolicyResult, base: PolicyResult) -> str:
    """A note for an event-count check whose policy and baseline both counted none (held:
    nothing to reduce), so "0 -> 0" never reads as a result of the policy."""
    field = {"throttling": "throttle_events", "power-cap": "power_cap_events"}
    for word, attr in field.items():
        if f"fewer {word} events" in check and getattr(r, attr) == getattr(base, attr) == 0:
            return " (no events either way)"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours (24)")
    ap.add_argument("--load", type=float, default=0.7, help="average load 0-1 (0.7)")
    ap.add_argument("--seed", type=int, default=1, help="trace seed (1)")
    ap.add_argument(
        "--bursts-per-hour", type=float, default=1.0, help="trace bursts per hour (1; 0: none)"
    )
    ap.add_argument(
        "--with-defaults",
        action="store_true",
        help="also run load_thermal with the gateway's default thermal/routing settings",
    )
    ap.add_argument("--plot", metavar="PNG", help="write temperature/power over time")
    ap.add_argument("--out", default=str(RESULTS), help="JSON results file")
    args = ap.parse_args(argv)

    console = Console(width=max(120, Console().width))
    racks = uneven_racks(16, 4)
    spec = FleetSpec(
        racks=racks,
        engine=FLEET_ENGINE,
        thermal=FLEET_THERMAL,
        weights=FLEET_WEIGHTS,
        seed=args.seed,
    )
    duration = args.hours * 3600.0
    ts = trace_for_load(
        spec,
        args.load,
        duration,
        args.seed,
        start_hour=0.0,
        diurnal_amplitude=0.3,
        bursts_per_hour=args.bursts_per_hour,
    )
    console.print(
        f"16 backends in 4 racks, {args.hours:g} simulated h, load {args.load}, "
        f"{ts.mean_rps:.2f} req/s mean before bursts, seed {args.seed}"
    )
    runs = [
        ("round_robin", spec),
        ("least_request", spec),
        ("load_thermal", spec),
        (CLOCKS, spec),
    ]
    if args.with_defaults:
        runs.append(
            (
                "load_thermal",
                dataclasses.replace(
                    spec, thermal=type(FLEET_THERMAL)(), weights=type(FLEET_WEIGHTS)()
                ),
            )
        )
    results = []
    for k, (policy, s) in enumerate(runs):
        t0 = time.perf_counter()
        r = simulate(s, policy, generate(ts), duration)
        if k == 4:
            r.policy = "load_thermal (gateway defaults)"
        console.log(f"{r.policy}: {r.arrived} requests in {time.perf_counter() - t0:.1f} s")
        results.append(r)
    print_results(results, console, title=f"Thermal benchmark: {args.hours:g} h, seed {args.seed}")

    by = {r.policy: r for r in results}
    gw, lr = by["load_thermal"], by["least_request"]
    rl = ratios(gw, lr)
    checks = {  # "lower" means by more than the measurement's resolution (0.1 °C, 1 W)
        # as issue 21's bar: none left is held (0 vs 0 included: no events either way)
        ">= 97% fewer throttling events": gw.throttle_events <= 0.03 * lr.throttle_events,
        "lower max temperature": gw.max_temp_c < lr.max_temp_c - 0.1,
        "lower peak domain power": gw.peak_domain_power_w < lr.peak_domain_power_w - 1.0,
        "goodput within 2%": abs(1.0 - rl["goodput_ratio"]) <= 0.02 or rl["goodput_ratio"] > 1.0,
    }
    defaults = {"hours": 24.0, "seed": 1, "load": 0.7, "bursts_per_hour": 1.0}
    changed = [f"--{k.replace('_', '-')} {getattr(args, k):g}" for k, v in defaults.items()
               if getattr(args, k) != v]  # fmt: skip
    if changed:
        console.print(
            f"[yellow]note: the bars below are judged on the default 24-h trace (seed 1, "
            f"load 0.7, 1 burst/h); this run ({', '.join(changed)}) only shows the direction, "
            "a FAILED here is not the benchmark's verdict[/yellow]"
        )
    console.print("[bold]issue 5, must hold (load_thermal vs least_request):[/bold]")
    for name, ok in checks.items():
        console.print(f"  {'held  ' if ok else 'FAILED'}  {name}{_none_either_way(name, gw, lr)}")
    if not checks["lower peak domain power"]:
        console.print(f"    why: {peak_diagnosis(gw, lr)}")
    ck = by[CLOCKS]
    bars = clocks_bars(ck, lr, gw)
    console.print(
        f"[bold]issue 21, must hold (clocks vs least_request)[/bold]: peak "
        f"{reduction(ck.peak_domain_power_w, lr.peak_domain_power_w):+.1%} lower, max temp "
        f"{reduction(ck.max_temp_c, lr.max_temp_c):+.1%} lower, energy/token "
        f"{reduction(ck.energy_per_token_j, lr.energy_per_token_j):+.1%} lower, goodput "
        f"x{ck.goodput_rps / lr.goodput_rps:.3f} (SLO attainment of served "
        f"{ck.served_slo_attainment:.2%}); refused for power / load {ck.rejected_power} / "
        f"{ck.rejected_load} (load_thermal {gw.rejected_power} / {gw.rejected_load}; "
        f"{TODAY_POWER_REFUSALS} for power at filing); "
        f"clock caps set {ck.clock_caps_set}, released {ck.clock_caps_released}"
    )
    for name, ok in bars.items():
        console.print(f"  {'held  ' if ok else 'FAILED'}  {name}{_none_either_way(name, ck, lr)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = json.loads(
        to_json(
            results,
            scenario={
                "backends": 16,
                "racks": [dataclasses.asdict(r) for r in racks],
                "hours": args.hours,
                "load": args.load,
                "seed": args.seed,
                "bursts_per_hour": args.bursts_per_hour,
                "mean_rps": ts.mean_rps,
            },
        )
    )
    body["must_hold"] = checks
    body["must_hold_clocks"] = bars
    out.write_text(json.dumps(body, indent=2))
    console.print(f"wrote {out}")
    if args.plot:
        write_plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    # a failed must-hold fails the command: 1 for issue 21's bars, 2 for issue 5's alone
    if not all(bars.values()):
        return 1
    return 0 if all(checks.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
