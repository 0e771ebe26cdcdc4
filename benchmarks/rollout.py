"""Canary rollout benchmark (issue 18): time to detect a regression vs its size, and false
rollbacks of a good canary.

Each scenario is a rollout of the default plan (steps 1, 5, 25, 50, 100 %; ``--step-s``
60 s and 100 canary requests per step at least; ``Thresholds`` defaults) over synthetic
traffic in simulated time (:func:`gateway.traffic.rollout_sim.simulate`: Poisson arrivals
at ``--rps`` 20 requests/s, lognormal TTFT / ITL, a 0.1 % baseline error rate, half the
requests in sessions, a calibration probe every 5 s), run for ``--runs`` seeds (20):

* a slower canary: TTFT x1.1, x1.25, x1.5, x2;
* a failing canary: error rate +1 and +5 percentage points;
* a drifted canary: 5 % of its calibration probes fail;
* a good canary (the same release): how many of the runs are rolled back (false
  rollbacks) and how long a promotion takes.

For each: rollouts rolled back (of the runs), the median and worst time to the rollback
(seconds of simulated time from the start), the steps the rollbacks happened at, and the
largest share of all requests the canary served before it (the bound: the first step's
share plus its minimum sample over the traffic). Prints the table and writes
``benchmarks/results/rollout.json``. Deterministic for the seeds; a few seconds on one core.

``--profile e2e`` runs the plan of ``benchmarks/rollout_e2e.py`` instead (0.5 s steps of
40 canary requests, 20 samples and 40 requests a side, ``recheck_s`` 0.2, 60 requests/s,
half streamed: a step is looked at ~20 times while its ITL sample fills), the case where
acting on any failing look (peeking) would show; it writes
``benchmarks/results/rollout_e2e_profile.json``. ``--scenarios`` picks scenarios by name.

**What it measured (2026-12-03, 2 shared cores, 20 seeds).** Good canary 0/20 rolled
back; TTFT x1.1 13/20 (at steps 2-4: it sits at the 10 % P50 tolerance); x1.25 20/20 (18
at step 0); x1.5 and x2 20/20 at step 0 (detected after 536 s median, canary share at most
1.21 %); errors +1 point 6/20, +5 points 20/20 (17 at step 0); 5 % calibration drift 20/20
at step 0 (100 s); every first-step rollback within the bound (97 of 97). Before the step
was decided once with alpha spent over the rollout and the 10 % / 20 % gates: x1.1 19/20,
x1.25 20/20 at step 0, errors +1 point 14/20, the rest the same. The good canary under the
e2e profile's repeated looks: see docs/architecture.md, "Canary rollouts: the statistics"
(13 of 400 false rollbacks before, 2 of 400 after).

Run: ``python benchmarks/rollout.py`` (``--runs 100`` for tighter figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.traffic.rollout import RolloutPlan
from gateway.traffic.rollout_sim import Outcome, Release, Traffic, simulate
from gateway.traffic.rollout_stats import Thresholds

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"
RESULTS_E2E_PROFILE = RESULTS.with_name("rollout_e2e_profile.json")

SCENARIOS: dict[str, Release] = {
    "good canary": Release(),
    "TTFT x1.1": Release(ttft_factor=1.1),
    "TTFT x1.25": Release(ttft_factor=1.25),
    "TTFT x1.5": Release(ttft_factor=1.5),
    "TTFT x2": Release(ttft_factor=2.0),
    "errors +1 pt": Release(extra_error_rate=0.01),
    "errors +5 pt": Release(extra_error_rate=0.05),
    "calibration 5 % drift": Release(calibration_failure_rate=0.05),
}


def summarize(name: str, outcomes: list[Outcome], plan: RolloutPlan) -> dict[str, Any]:
    """One scenario's figures (times in simulated seconds, shares as fractions);
    ``first_step_within_bound``: of the rollbacks at the first step, those where the canary
    served at most the first step's share of all requests plus the step's minimum sample."""
    back = [o for o in outcomes if o.status == "rolled_back"]
    promoted = [o for o in outcomes if o.status == "promoted"]
    times = [o.decided_after_s for o in back if o.decided_after_s is not None]
    promo = [o.decided_after_s for o in promoted if o.decided_after_s is not None]
    return {
        "scenario": name,
        "runs": len(outcomes),
        "rolled_back": len(back),
        "promoted": len(promoted),
        "undecided": len(outcomes) - len(back) - len(promoted),
        "detect_median_s": statistics.median(times) if times else None,
        "detect_max_s": max(times) if times else None,
        "rollback_steps": dict(sorted(Counter(o.step for o in back).items())),
        "max_canary_share_before_rollback": max((o.canary_share for o in back),
                                                default=None),
        "promotion_median_s": statistics.median(promo) if promo else None,
        "reasons": dict(Counter(o.reason.split(":")[0].split(" ")[0] for o in back)),
        "looks_mean": statistics.mean(o.looks for o in outcomes) if outcomes else None,
        "first_step_rollbacks": sum(1 for o in back if o.step == 0),
        "first_step_within_bound": sum(
            1 for o in back if o.step == 0 and o.canary_requests
            <= plan.steps[0] * o.total_requests + plan.min_step_requests),
    }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="seeds per scenario")
    ap.add_argument("--rps", type=float, default=20.0, help="requests per second")
    ap.add_argument("--step-s", type=float, default=60.0, help="min_step_s (seconds)")
    ap.add_argument("--step-requests", type=int, default=100, help="min_step_requests")
    ap.add_argument("--stream-share", type=float, default=1.0,
                    help="share of requests streamed (only those have an ITL sample)")
    ap.add_argument("--profile", choices=("default", "e2e", "trial"), default="default",
                    help="e2e: rollout_e2e.py's short steps (min_step_s 0.5, 40 requests, "
                    "min_samples 20, min_requests 40, recheck_s 0.2) at 60 requests/s, half "
                    "streamed: a step is looked at every 0.2 s until its ITL sample is in; "
                    "trial: issue 18's trial (steps 10/50/100 %%, min_step_s 10, 20 "
                    "requests / samples a side) at 7 requests/s")
    ap.add_argument("--scenarios", default="",
                    help="comma-separated scenario names (default: all)")
    args = ap.parse_args()
    if args.profile == "e2e":
        plan = RolloutPlan(model="m", baseline="v1", canary="v2", min_step_s=0.5,
                           min_step_requests=40, recheck_s=0.2, max_step_s=900,
                           thresholds=Thresholds(min_samples=20, min_requests=40))
        traffic = Traffic(rate_rps=60.0, stream_share=0.5, probe_interval_s=0.1)
    elif args.profile == "trial":
        plan = RolloutPlan(model="m", baseline="v1", canary="v2", steps=(0.1, 0.5, 1.0),
                           min_step_s=10, min_step_requests=20,
                           thresholds=Thresholds(min_samples=20, min_requests=20))
        traffic = Traffic(rate_rps=7.0)
    else:
        plan = RolloutPlan(model="m", baseline="v1", canary="v2", min_step_s=args.step_s,
                           min_step_requests=args.step_requests)
        traffic = Traffic(rate_rps=args.rps, stream_share=args.stream_share)
    wanted = [w for w in args.scenarios.split(",") if w]
    started = time.perf_counter()
    rows = [summarize(name, [simulate(plan, release, traffic, seed)
                             for seed in range(args.runs)], plan)
            for name, release in SCENARIOS.items() if not wanted or name in wanted]
    header = (f"{'scenario':24} {'rolled back':>11} {'promoted':>8} {'detect P50 s':>12} "
              f"{'worst s':>8} {'at steps':>16} {'max canary share':>16}")
    print(f"plan: steps {list(plan.steps)}, min_step_s {plan.min_step_s:g}, "
          f"min_step_requests {plan.min_step_requests}; {traffic.rate_rps:g} requests/s, "
          f"{traffic.stream_share:.0%} streamed; {args.runs} seeds each")
    print(header)
    print("-" * len(header))
    for r in rows:
        share = r["max_canary_share_before_rollback"]
        print(f"{r['scenario']:24} {r['rolled_back']:>5}/{r['runs']:<5} {r['promoted']:>8} "
              f"{_fmt(r['detect_median_s'], '.0f'):>12} {_fmt(r['detect_max_s'], '.0f'):>8} "
              f"{json.dumps(r['rollback_steps']):>16} "
              f"{_fmt(share * 100 if share is not None else None, '.2f') + ' %':>16}")
    bad = [r for r in rows if r["scenario"] != "good canary"]
    first = sum(r["first_step_rollbacks"] for r in bad)
    within = sum(r["first_step_within_bound"] for r in bad)
    print(f"\nrollbacks at the first step within the bound (canary requests <= "
          f"{plan.steps[0]:g} x requests + {plan.min_step_requests}): {within} of {first}")
    for good in (r for r in rows if r["scenario"] == "good canary"):
        print(f"\nfalse rollbacks of a good canary: {good['rolled_back']} of {good['runs']} "
              f"(promoted in {_fmt(good['promotion_median_s'], '.0f')} s, median; "
              f"{good['looks_mean']:.1f} comparisons a rollout, 1 acted on a step)")
    print(f"({time.perf_counter() - started:.1f} s)")
    out = {"e2e": RESULTS_E2E_PROFILE, "trial": RESULTS.with_name("rollout_trial.json")}.get(
        args.profile, RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "plan": {"steps": list(plan.steps), "min_step_s": plan.min_step_s,
                 "min_step_requests": plan.min_step_requests},
        "traffic": {"rate_rps": traffic.rate_rps, "stream_share": traffic.stream_share},
        "profile": args.profile, "runs": args.runs,
        "scenarios": rows}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
