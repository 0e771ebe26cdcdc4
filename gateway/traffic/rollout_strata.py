"""Canary vs baseline latencies compared at matched load (issue 18; pure).

A request's TTFT and ITL depend on how loaded its backend was as much as on the build: a
server with ten requests in flight queues and batches a new one, an idle one answers at
once. A rollout's versions carry different loads per server (a 1 % step on three canary
servers beside one busy baseline server; a 50 % step on one canary server beside two
baseline ones), so a plain comparison of the two samples measures the load as much as the
build: it hid a TTFT x1.5 canary whose idle servers were faster than the loaded baseline,
and rolled back a good one carrying twice the baseline's per-server load
(``benchmarks/rollout_e2e.py``, a new user's trial).

So each latency sample carries its **stratum**: the serving backend's requests in flight
when the attempt was sent (this one included), in powers of two (:func:`load_stratum`: 1,
2, 3-4, 5-8, ...; 0 when unknown); a TTFT's stratum also has its **prefill load**
(:func:`ttft_stratum`, :func:`prefill_class`: exact to 4, then powers of two).

*Why a TTFT needs the prefill load.* In vLLM without chunked prefill a step runs every
request's next token plus the whole prefill of every request it admits (the cost model of
:mod:`gateway.sim.engine`, after Vidur, Agrawal et al. 2024), so a request's first token
waits for the prefills ahead of it and those admitted with it, while requests already
decoding cost it one short step each. Requests in flight count both alike. A version
served by one server of a pool of four (a 25 % step on one canary server beside three
baseline ones, the same load per server) is not compared like with like at equal requests
in flight: the router sends each baseline request to the least loaded of three servers,
away from one that was just sent a request, while every canary request goes to the one
canary server, whatever it is doing. End to end (``benchmarks/rollout_e2e.py --fleet 3+1
--steps 0.25,0.5,0.75,0.9,1.0 --min-step-s 15 --first-decision``) a good canary was rolled
back at that step in 6 of 20 runs on TTFT P50 x1.08-1.36 at matched in-flight strata (p
down to 5e-6); within one in-flight stratum the canary's requests waited behind more
prefills.
The prefill load is the backend's requests sent and not yet past their first token
(:attr:`gateway.fleet.backend.Backend.prefill_load`; a stream's first events, a
non-stream's whole answer, which the gateway cannot see earlier; calibration rounds count
one), this one included, at the larger of the send and its own first token: a request sent
there after this one and admitted with it (same step) lengthens its first token as much as
one ahead of it, and the canary's one server meets all of those where the baseline's
router spreads them (at the send alone: 1 of 10 rolled back, x1.15 left within a stratum;
with the larger: 0 of 18, P50 median x1.02). Counted at the first token it also takes in
requests that came after this one's prefill and did not delay it; a slower build waits
longer and meets more of them, so it is compared against a baseline at a little more load:
a tilt in the slower build's favour, measured: TTFT x1.5 on the same fleet is still rolled
back at that step (5 of 5; docs/architecture.md). With chunked prefill (vLLM v1's default)
a prefill is spread over steps and the effect is smaller, but its direction the same.

The comparison uses only the strata both versions have samples in:

* **the test**: van Elteren's stratified Wilcoxon-Mann-Whitney test (van Elteren 1960; the
  standard test for a shift within strata, e.g. Lehmann, *Nonparametrics*, ch. 3): per
  stratum ``s`` the Mann-Whitney U of canary over baseline with its mean ``n_c n_b / 2`` and
  tie-corrected variance, combined with weights ``w_s = 1 / (n_s + 1)`` into ``Z = sum w_s
  (U_s - E_s) / sqrt(sum w_s^2 Var_s)``; one-sided p from the normal tail. With one stratum it
  is exactly the plain test (:func:`gateway.traffic.rollout_stats.mann_whitney_greater`,
  continuity correction included);
* **the effect gate** (P50 / P99 ratios): on the canary's matched samples against a
  baseline sample re-weighted to the canary's mix of strata (for each stratum, as many
  quantiles of the baseline's values there as the canary has samples: ``(k + 0.5) / n_c``).

Samples in a stratum only one version has are not compared (counted in the numbers): when
too few remain on either side (``min_samples``) the metric is insufficient: the versions
never ran at a comparable load, and no verdict is better than a wrong one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from gateway.traffic.rollout_stats import (
    MetricResult,
    Number,
    Thresholds,
    compare_latency,
    latency_verdict,
    normal_sf,
    not_measured,
    u_statistic,
)

Pairs = tuple[Sequence[float], Sequence[int]]


def load_stratum(in_flight: int) -> int:
    """The stratum of a sample taken at ``in_flight`` requests on its backend (this one
    included): 0 when unknown (<= 0), else ``ceil(log2(in_flight)) + 1`` (1 -> 1, 2 -> 2,
    3-4 -> 3, 5-8 -> 4, ...)."""
    if in_flight <= 0:
        return 0
    return math.ceil(math.log2(in_flight)) + 1


PREFILL_EXACT = 4
"""Prefill loads up to this are strata of their own (1, 2, 3, 4); above it, powers of two
(5-8, 9-16, ...): each request waiting ahead of a new one's first token adds a whole
prefill to its TTFT, so at small counts one more is a large step (module docstring)."""

STRATA_BASE = 100
"""A combined stratum is ``prefill class x STRATA_BASE + load class`` (both classes are far
below it: a load class is ``ceil(log2(n)) + 1``, 33 for four billion requests)."""


def prefill_class(prefill_load: int) -> int:
    """The class of a prefill load (the backend's requests not yet past their first token
    when this one was sent, this one included; :attr:`gateway.fleet.backend.Backend
    .prefill_load`): 0 when unknown (<= 0), the count itself up to :data:`PREFILL_EXACT`,
    then ``PREFILL_EXACT + ceil(log2(n)) - 2`` (5-8 -> 5, 9-16 -> 6, ...)."""
    if prefill_load <= 0:
        return 0
    if prefill_load <= PREFILL_EXACT:
        return prefill_load
    return PREFILL_EXACT + math.ceil(math.log2(prefill_load)) - 2


WHOLE_ANSWER = 1_000_000
"""Added to the stratum of a TTFT that is a whole answer's time (a non-streamed request:
its first token reaches the client with its last), so that it is compared only with other
whole answers. Pooled with streams' first tokens, a user's trial at half streamed traffic
(16 tokens) read a good canary's TTFT P50 at x5.67: the median fell between the clusters."""


def ttft_stratum(load: int, prefill_load: int = 0, streamed: bool = True) -> int:
    """The stratum of a TTFT sample (module docstring): the prefill load's class and the
    requests in flight's (:func:`load_stratum`), combined (:data:`STRATA_BASE`); the load's
    class alone when the prefill load is unknown (0); plus :data:`WHOLE_ANSWER` when the
    sample is a non-streamed request's whole answer time."""
    whole = 0 if streamed else WHOLE_ANSWER
    return whole + prefill_class(prefill_load) * STRATA_BASE + load_stratum(load)


def by_stratum(values: Sequence[float], strata: Sequence[int]) -> dict[int, list[float]]:
    """``values`` grouped by their stratum (parallel sequences)."""
    out: dict[int, list[float]] = defaultdict(list)
    for v, s in zip(values, strata, strict=True):
        out[s].append(v)
    return out


def matched(baseline: Pairs, canary: Pairs) -> list[tuple[int, list[float], list[float]]]:
    """The strata both sides have samples in: ``(stratum, baseline values, canary
    values)``, by stratum."""
    b, c = by_stratum(*baseline), by_stratum(*canary)
    return [(s, b[s], c[s]) for s in sorted(set(b) & set(c))]


def van_elteren_greater(groups: Sequence[tuple[int, Sequence[float], Sequence[float]]]
                        ) -> tuple[float, float]:
    """One-sided van Elteren test that the canary is stochastically greater (slower) than
    the baseline within strata (module docstring): ``(Z, p-value)``. One stratum: the plain
    Mann-Whitney test's own numbers (continuity-corrected). No variance: ``(0, 1)``. Needs
    every group non-empty on both sides."""
    if len(groups) == 1:
        _, b, c = groups[0]
        u, var = u_statistic(c, b)
        if var <= 0.0:
            return 0.0, 1.0
        z = (u - len(c) * len(b) / 2.0 - 0.5) / math.sqrt(var)
        return z, normal_sf(z)
    num = 0.0
    den = 0.0
    for _, b, c in groups:
        u, var = u_statistic(c, b)
        w = 1.0 / (len(b) + len(c) + 1)
        num += w * (u - len(c) * len(b) / 2.0)
        den += w * w * var
    if den <= 0.0:
        return 0.0, 1.0
    z = num / math.sqrt(den)
    return z, normal_sf(z)


def reweighted_baseline(groups: Sequence[tuple[int, Sequence[float], Sequence[float]]]
                        ) -> list[float]:
    """A baseline sample with the canary's mix of strata: per stratum, as many of the
    baseline's quantiles there as the canary has samples (module docstring)."""
    out: list[float] = []
    for _, b, c in groups:
        s, n = sorted(b), len(c)
        for k in range(n):
            pos = (len(s) - 1) * (k + 0.5) / n
            lo = math.floor(pos)
            hi = min(lo + 1, len(s) - 1)
            out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out


def compare_latency_matched(metric: str, baseline: Pairs, canary: Pairs, th: Thresholds,
                            baseline_requests: int | None = None) -> MetricResult:
    """:func:`gateway.traffic.rollout_stats.compare_latency` at matched load (module
    docstring): ``baseline`` / ``canary`` are (values in seconds, strata). When every sample
    of both is in one stratum it is the plain comparison; else only the strata both have
    are compared (van Elteren's test, the effect gate on the re-weighted baseline), and too
    few samples there is ``insufficient``, naming the load mismatch."""
    b_vals, b_str = baseline
    c_vals, c_str = canary
    if (not_measured(baseline_requests, len(b_vals), th)
            or len(set(b_str) | set(c_str)) <= 1):
        return compare_latency(metric, b_vals, c_vals, th, baseline_requests)
    groups = matched(baseline, canary)
    nb = sum(len(b) for _, b, _ in groups)
    nc = sum(len(c) for _, _, c in groups)
    numbers: dict[str, Number] = {
        "baseline_n": len(b_vals), "canary_n": len(c_vals), "matched_baseline_n": nb,
        "matched_canary_n": nc, "strata": len(groups)}
    if nb < th.min_samples or nc < th.min_samples:
        return MetricResult(
            metric, "insufficient",
            f"{metric}: {nc} canary / {nb} baseline samples at a load both versions ran at "
            f"({th.min_samples} needed on each side; of {len(c_vals)} / {len(b_vals)}: the "
            f"canary's servers and the baseline's carry different loads per server)", numbers)
    canary_all = [v for _, _, c in groups for v in c]
    z, p = van_elteren_greater(groups)
    numbers["z"] = z
    return latency_verdict(metric, reweighted_baseline(groups), canary_all, p, th, numbers,
                           "van Elteren", " at matched load")

