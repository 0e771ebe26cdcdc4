"""A rollout over synthetic traffic in simulated time (pure, seeded): how long a
regression of a given size takes to be rolled back, and how many requests the canary
served meanwhile (issue 18's ``benchmarks/rollout.py`` calls :func:`simulate`).

The traffic: Poisson arrivals at ``rate_rps``; every request ends at once (its latencies
are samples, not waits); TTFT and ITL lognormal around their medians (seconds; a lognormal
is the usual shape of serving latencies, its ``sigma`` the spread of log-latency); errors
Bernoulli; a share of the requests carries one of ``sessions`` session keys. The canary is
the baseline times ``ttft_factor`` / ``itl_factor``, plus ``extra_error_rate``; its
calibration probes (one every ``probe_interval_s``) fail at ``calibration_failure_rate``,
spread evenly (probe k fails when ``floor((k + 1) r) > floor(k r)``), so a drifted canary's
failure share is exact rather than a draw.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gateway.core.vocab import Prio
from gateway.traffic.rollout import Rollout, RolloutPlan, Status


@dataclass(frozen=True)
class Release:
    """What the canary does relative to the baseline: latency factors (unitless), the
    error rate it adds (fraction of requests), its calibration failure rate (fraction of
    probes)."""

    ttft_factor: float = 1.0
    itl_factor: float = 1.0
    extra_error_rate: float = 0.0
    calibration_failure_rate: float = 0.0


@dataclass(frozen=True)
class Traffic:
    """The synthetic traffic: ``rate_rps`` (requests per second), the baseline's TTFT and
    ITL medians (seconds) and lognormal sigmas, its error rate (fraction), the share of
    requests with a session key and the number of sessions, the calibration probe period
    (seconds), the share of requests streamed (only those have an ITL sample: below 1, a
    step waits for its ITL sample after its TTFT one is complete, and is looked at every
    ``recheck_s`` meanwhile)."""

    rate_rps: float = 20.0
    ttft_median_s: float = 0.25
    ttft_sigma: float = 0.5
    itl_median_s: float = 0.03
    itl_sigma: float = 0.3
    baseline_error_rate: float = 0.001
    session_share: float = 0.5
    sessions: int = 2000
    probe_interval_s: float = 5.0
    stream_share: float = 1.0


@dataclass(frozen=True)
class Outcome:
    """How a simulated rollout ended: ``status`` (``running`` when ``max_s`` ran out),
    the step index it ended at, ``decided_after_s`` (seconds from the start to the rollback
    or promotion; None when still running), the reason, the requests the canary served and
    all requests (counts), the canary's share of them, and the comparisons made (looks,
    counted over every step)."""

    status: Status
    step: int
    decided_after_s: float | None
    reason: str
    canary_requests: int
    total_requests: int
    canary_share: float
    looks: int = 0


def simulate(plan: RolloutPlan, release: Release, traffic: Traffic, seed: int,
             max_s: float = 36_000.0) -> Outcome:
    """Run one rollout of ``plan`` over ``traffic`` with the canary behaving as ``release``
    for at most ``max_s`` simulated seconds; deterministic for a ``seed``."""
    rng = random.Random(seed)
    rollout = Rollout(plan, 0.0, random.Random(seed + 1_000_003))
    mu_ttft, mu_itl = math.log(traffic.ttft_median_s), math.log(traffic.itl_median_s)
    t = 0.0
    next_probe = traffic.probe_interval_s
    probes = 0
    while rollout.status == "running" and t < max_s:
        t += rng.expovariate(traffic.rate_rps)
        while next_probe <= t and rollout.status == "running":
            r = release.calibration_failure_rate
            failed = math.floor((probes + 1) * r) > math.floor(probes * r)
            rollout.record_probe(not failed)
            probes += 1
            rollout.tick(next_probe)
            next_probe += traffic.probe_interval_s
        session = (f"s{rng.randrange(traffic.sessions)}"
                   if rng.random() < traffic.session_share else None)
        version = rollout.assign(session, None, Prio.NORMAL, t)
        canary = version == "canary"
        ttft = math.exp(rng.gauss(mu_ttft, traffic.ttft_sigma))
        itl: float | None = math.exp(rng.gauss(mu_itl, traffic.itl_sigma))
        if traffic.stream_share < 1.0 and rng.random() >= traffic.stream_share:
            itl = None
        err_rate = traffic.baseline_error_rate
        if canary:
            ttft *= release.ttft_factor
            itl = None if itl is None else itl * release.itl_factor
            err_rate += release.extra_error_rate
        error = rng.random() < err_rate
        rollout.observe(version, None if error else ttft, None if error else itl, error)
    decided = rollout.history[-1].at if rollout.status != "running" else None
    reason = rollout.history[-1].reason if rollout.history else ""
    served = rollout.served
    total = served["baseline"] + served["canary"]
    return Outcome(rollout.status, rollout.step, decided, reason, served["canary"], total,
                   served["canary"] / total if total else 0.0, rollout.looks)
