"""Canary vs baseline on one rollout step's window (pure: no I/O, data as arguments).

Issue 18, "Model versions and rollouts": every step compares the canary version with the
baseline version on the same window, and a failure rolls the canary back. Four metrics:

* **TTFT and ITL** (seconds, one sample per request; ITL: a request's mean inter-token
  latency): a regression is *significant* (a one-sided Mann-Whitney U test, the canary
  stochastically larger than the baseline, p below the per-test alpha) **and** *large
  enough to matter* (canary P50 / baseline P50 at least ``1 + p50_tolerance``, or the same
  for P99 with ``p99_tolerance``). The test alone would roll back a 1 % slowdown seen on a
  million requests; the effect gate alone would roll back the noise of a P99 read off a
  hundred samples. Both together is the shape of Kayenta's ``MannWhitneyClassifier``
  (Spinnaker / Netflix automated canary analysis: a Mann-Whitney test plus an effect-size
  bound). The rank test needs no distribution (latencies are skewed, long-tailed) and is
  insensitive to a few outliers.
* **Error rate** (errors / requests): a one-sided pooled two-proportion z-test (the canary
  rate above the baseline's; Agresti, *Categorical Data Analysis*), or Fisher's exact test
  when the expected error counts are too small for the normal approximation
  (:data:`Z_TEST_MIN_EXPECTED`), **and** an absolute gate (the canary rate at least
  ``error_rate_gate`` above, 0.5 percentage points by default).
* **Calibration**: the baseline version's answers to the fixed calibration prompts are the
  reference; a canary probe fails when its answer does not match by the configured measure
  (:mod:`gateway.traffic.calibration_match`: exact text, token-overlap F1, or embedding
  cosine). More than
  ``calibration_max_failures`` (2 %) of the canary's probes failing fails the step whatever
  the latencies say (the issue's rule: a rule on counts, not a test).

**Three verdicts, not two: a step passes only on evidence** (issue 18's trial: a TTFT x1.5
canary passed its first step on P50 x1.25 at p = 0.056, 46 canary samples, because "not
significant" counted as a pass). A release gate is a *non-inferiority* question, "is the
canary no worse than the baseline by more than the tolerance?", and the burden of proof is
on the new version: a test without the power to see a regression is no evidence that there
is none (FDA, *Non-Inferiority Clinical Trials to Establish Effectiveness*, guidance for
industry, 2016: the non-inferiority margin, and why failing to show a difference shows
nothing; Kohavi, Tang & Xu, *Trustworthy Online Controlled Experiments*, 2020, on
guardrail metrics and statistical power: an underpowered guardrail lets harm through). So
each metric, once its sample is in:

* ``fail``: the regression is significant **and** the observed effect reaches its gate
  (a P50 / P99 ratio, the error rate's excess);
* ``inconclusive``: the observed effect reaches the gate but is **not (yet)** significant:
  the canary looks worse beyond the tolerance and the sample cannot tell; the step goes on
  collecting samples (:class:`gateway.traffic.rollout.Rollout`: re-compared every
  ``recheck_s``, like ``insufficient``) and, still inconclusive at ``max_step_s``, is rolled
  back with reason ``inconclusive`` (the baseline is the version known to be good);
* ``pass``: the observed effect is within the gate (significant or not: the test alone
  would roll back a 1 % slowdown on a million requests).

The per-test alpha is ``alpha / 3`` (Bonferroni over the three tests: TTFT, ITL, errors),
so a good canary fails a comparison with probability at most ``alpha``; a rollout compares
each of its steps once (:class:`gateway.traffic.rollout.Rollout`) at ``alpha / steps``
(:meth:`Thresholds.per_step`), so a good canary is rolled back by the tests in at most
``alpha`` (1 %) of its rollouts, whatever the number of steps and of looks at them; an
inconclusive step is looked at again, on a larger sample, only while its observed effect
stays over the gate (the false-rollback figures this costs: ``benchmarks/rollout.py``).

The p-values and percentiles are :mod:`gateway.traffic.rollout_pvalues`' (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.traffic.rollout_pvalues import (
    fisher_greater,
    mann_whitney_greater,
    normal_sf,
    percentile,
    two_proportion_greater,
    u_statistic,
)
from gateway.traffic.rollout_thresholds import TESTS_COMPARED, Thresholds

__all__ = ["TESTS_COMPARED", "Z_TEST_MIN_EXPECTED", "Comparison", "Decision", "MetricResult",
           "Number", "Thresholds", "combine", "compare_calibration", "compare_errors",
           "compare_latency", "effect_verdict", "fisher_greater", "latency_verdict",
           "mann_whitney_greater", "normal_sf", "not_measured", "percentile",
           "two_proportion_greater", "u_statistic"]

Decision = Literal["pass", "fail", "inconclusive", "insufficient"]
"""One metric's or one step's verdict: ``insufficient`` while either side lacks samples,
``inconclusive`` while the observed effect is over its gate but not significant (module
docstring)."""

Number = float | int | None

Z_TEST_MIN_EXPECTED = 5.0
"""Expected errors (and successes) on the smaller side, at the pooled rate, below which the
error test is Fisher's exact test instead of the z-test: the textbook validity condition
of the normal approximation, ``n p >= 5`` and ``n (1 - p) >= 5`` (5 or more successes and
failures on each side). Measured: with the z-test alone, 1 error in the canary's first 100 requests
against a 0.1 % baseline gave p ~ 3e-4 (the exact chance is ~10 %) and rolled back 4 of 20
good canaries."""

P99_MIN_SAMPLES = 100
"""Samples each side needs before the P99 gate counts: the 99th percentile of fewer than
100 values is their largest or next to it, a single draw (a user's trial: an x1.25 release
allowed x1.45 at P99 was rolled back at the last step on P99 x1.49 read off the previous
step's 29 baseline samples). Below it the P99 is shown, marked "not gated"."""

NOT_MADE_SHARE = 0.1
"""The share of a version's requests below which a metric only some requests have (ITL:
streams of two tokens or more) counts as not made by the traffic (:func:`not_measured`):
a model served almost only without streams, or embeddings."""

@dataclass(frozen=True)
class MetricResult:
    """One metric's comparison: ``metric`` (``ttft``, ``itl``, ``error_rate``,
    ``calibration``), its ``decision``, a ``reason`` naming the metric, and its ``numbers``
    (sample sizes ``baseline_n`` / ``canary_n``, P50/P99 in seconds and their ratios, rates,
    the p-value; None where not computed)."""

    metric: str
    decision: Decision
    reason: str
    numbers: dict[str, Number] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (floats rounded to 6 significant digits)."""
        return {"metric": self.metric, "decision": self.decision, "reason": self.reason,
                **{k: _round(v) for k, v in self.numbers.items()}}


@dataclass(frozen=True)
class Comparison:
    """A step's verdict over its metrics: ``fail`` when any metric fails (the first failing
    one, calibration first, gives the ``reason``), else ``insufficient`` when any lacks
    samples, else ``inconclusive`` when any is over its gate without significance, else
    ``pass``."""

    decision: Decision
    reason: str
    metrics: tuple[MetricResult, ...]

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict for ``/admin/rollouts``."""
        return {"decision": self.decision, "reason": self.reason,
                "metrics": [m.to_json() for m in self.metrics]}

    def metric(self, name: str) -> MetricResult:
        """The result of one metric by name (KeyError when not compared)."""
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)


def _round(v: Number) -> Number:
    if isinstance(v, float) and math.isfinite(v) and v != 0.0:
        return float(f"{v:.6g}")
    return v


def not_measured(baseline_requests: int | None, baseline_samples: int,
                 th: Thresholds) -> bool:
    """Whether a metric only some requests have (``baseline_requests`` given) is not made
    by the traffic: the baseline served ``th.min_requests`` requests or more yet gave fewer
    than ``th.min_samples`` samples, and fewer than :data:`NOT_MADE_SHARE` of its requests
    gave one (:func:`compare_latency`). Half-streamed traffic makes the metric, just more
    slowly: it waits for its samples (a user's trial: 36 baseline requests with 14 ITL
    samples had been passed as "not measured", untested)."""
    return (baseline_requests is not None and baseline_requests >= th.min_requests
            and baseline_samples < th.min_samples
            and baseline_samples < NOT_MADE_SHARE * baseline_requests)


def compare_latency(
    metric: str, baseline: Sequence[float], canary: Sequence[float], th: Thresholds,
    baseline_requests: int | None = None,
) -> MetricResult:
    """Canary vs baseline latencies (seconds) of one metric (``ttft`` or ``itl``): fail
    when the Mann-Whitney test is significant at ``th.alpha_each`` and the P50 ratio is at
    least ``1 + p50_tolerance`` or the P99 ratio at least ``1 + p99_tolerance``;
    insufficient below ``th.min_samples`` on either side.

    ``baseline_requests`` (for a metric only some requests have: ITL needs a stream of two
    tokens or more): when the baseline served at least ``th.min_requests`` requests yet gave
    fewer than ``th.min_samples`` samples, the model's traffic does not make this metric
    (non-streaming clients, embeddings): it passes as not measured instead of holding every
    step until ``max_step_s`` and rolling a good canary back for want of samples that will
    never come."""
    nb, nc = len(baseline), len(canary)
    numbers: dict[str, Number] = {"baseline_n": nb, "canary_n": nc}
    if not_measured(baseline_requests, nb, th):
        return MetricResult(metric, "pass",
                            f"{metric}: not measured: {baseline_requests} baseline requests "
                            f"gave {nb} samples, {th.min_samples} needed (too few of the "
                            f"traffic's requests have one)", numbers)
    if nb < th.min_samples or nc < th.min_samples:
        return MetricResult(metric, "insufficient",
                            f"{metric}: {nc} canary / {nb} baseline samples, "
                            f"{th.min_samples} needed on each side", numbers)
    u, p = mann_whitney_greater(canary, baseline)
    numbers["u"] = u
    return latency_verdict(metric, baseline, canary, p, th, numbers, "Mann-Whitney")


def effect_verdict(significant: bool, over_gate: bool, leaning: bool = True) -> Decision:
    """The three-way rule of a metric whose sample is in (module docstring, "Three
    verdicts"): ``fail`` when the test is significant and the observed effect reaches the
    gate, ``inconclusive`` when the effect reaches the gate and the test leans toward a
    regression (``leaning``: p below ``Thresholds.lean_p``) but is not (yet) significant
    (a non-inferiority gate passes only on evidence: FDA 2016 non-inferiority guidance;
    Kohavi et al. 2020 on guardrail metrics), else ``pass`` (within the gate, or over it
    with a test that does not lean: a percentile's noise)."""
    if not over_gate:
        return "pass"
    if significant:
        return "fail"
    return "inconclusive" if leaning else "pass"


def latency_verdict(metric: str, baseline: Sequence[float], canary: Sequence[float],
                    p: float, th: Thresholds, numbers: dict[str, Number], test: str,
                    qualifier: str = "") -> MetricResult:
    """The latency rule once the test's one-sided ``p`` is known (:func:`effect_verdict`):
    the gate is the canary's P50 / P99 over the ``baseline`` sample's reaching ``1 +
    p50_tolerance`` / ``1 + p99_tolerance``, the test significant at ``th.alpha_each``: fail
    when both, inconclusive when over the gate alone, else pass (``numbers`` gets the
    percentiles, ratios and p; ``test`` and ``qualifier`` name them in the reason)."""
    b50, b99 = percentile(baseline, 50), percentile(baseline, 99)
    c50, c99 = percentile(canary, 50), percentile(canary, 99)
    r50 = c50 / b50 if b50 > 0 else math.inf
    r99 = c99 / b99 if b99 > 0 else math.inf
    numbers.update({"baseline_p50_s": b50, "canary_p50_s": c50, "p50_ratio": r50,
                    "baseline_p99_s": b99, "canary_p99_s": c99, "p99_ratio": r99,
                    "p_value": p, "alpha": th.alpha_each})
    significant = p < th.alpha_each
    over = []
    if r50 >= 1.0 + th.p50_tolerance:
        over.append(f"P50 x{r50:.3g} over its x{1 + th.p50_tolerance:.3g} gate")
    p99_gated = min(len(baseline), len(canary)) >= P99_MIN_SAMPLES
    if p99_gated and r99 >= 1.0 + th.p99_tolerance:
        over.append(f"P99 x{r99:.3g} over its x{1 + th.p99_tolerance:.3g} gate")
    verdict = effect_verdict(significant, bool(over), p < th.lean_p)
    ratios = f"P50 x{r50:.3g}, P99 x{r99:.3g}" + ("" if p99_gated else " (not gated)")
    if verdict == "fail":
        return MetricResult(metric, "fail",
                            f"{metric} regression{qualifier}: {ratios}, "
                            f"{test} p={p:.3g} < {th.alpha_each:.3g}", numbers)
    if verdict == "inconclusive":
        return MetricResult(metric, "inconclusive",
                            f"{metric} inconclusive{qualifier}: {'; '.join(over)}, {test} "
                            f"p={p:.3g} leans toward a regression (< {th.lean_p:g}) but is "
                            f"not below {th.alpha_each:.3g} yet: more samples needed", numbers)
    why = ("below the tolerances" if significant else
           f"{'; '.join(over)}, but the test does not lean toward a regression (p >= "
           f"{th.lean_p:g})" if over else "not significant")
    return MetricResult(metric, "pass",
                        f"{metric}{qualifier}: {ratios}, p={p:.3g} ({why})", numbers)


def compare_errors(
    baseline_errors: int, baseline_n: int, canary_errors: int, canary_n: int,
    th: Thresholds,
) -> MetricResult:
    """Canary vs baseline error rate (errors / requests), :func:`effect_verdict` with the
    gate ``canary rate - baseline rate >= th.error_rate_gate`` and the one-sided test (the
    pooled z-test, Fisher's exact test below :data:`Z_TEST_MIN_EXPECTED`) at
    ``th.alpha_each``: fail when both, inconclusive when the excess is over the gate but not
    significant (the small-sample case: 2 errors in the canary's first 40 requests, 5 %,
    against 4 in 4000 has Fisher p = 0.0014: no proof at a five-step rollout's 0.00067, no
    evidence of health either), else pass; insufficient below ``th.min_requests`` a side."""
    numbers: dict[str, Number] = {"baseline_n": baseline_n, "canary_n": canary_n,
                                  "baseline_errors": baseline_errors,
                                  "canary_errors": canary_errors}
    if baseline_n < th.min_requests or canary_n < th.min_requests:
        return MetricResult("error_rate", "insufficient",
                            f"error_rate: {canary_n} canary / {baseline_n} baseline "
                            f"requests, {th.min_requests} needed on each side", numbers)
    rb, rc = baseline_errors / baseline_n, canary_errors / canary_n
    pooled = (baseline_errors + canary_errors) / (baseline_n + canary_n)
    expected = min(canary_n, baseline_n) * min(pooled, 1.0 - pooled)
    z: float | None = None
    if expected >= Z_TEST_MIN_EXPECTED:
        test = "z"
        z, p = two_proportion_greater(canary_errors, canary_n, baseline_errors, baseline_n)
    else:
        test = "fisher"
        p = fisher_greater(canary_errors, canary_n, baseline_errors, baseline_n)
    numbers.update({"baseline_rate": rb, "canary_rate": rc, "difference": rc - rb,
                    "z": z, "p_value": p, "alpha": th.alpha_each})
    verdict = effect_verdict(p < th.alpha_each, rc - rb >= th.error_rate_gate - 1e-12,
                             p < th.lean_p)
    rates = f"{rc:.2%} vs {rb:.2%}"
    if verdict == "fail":
        return MetricResult("error_rate", "fail",
                            f"error_rate regression: {rates}, "
                            f"{test} test p={p:.3g} < {th.alpha_each:.3g}", numbers)
    if verdict == "inconclusive":
        return MetricResult("error_rate", "inconclusive",
                            f"error_rate inconclusive: {rates}, over the "
                            f"{th.error_rate_gate:.2%} gate, {test} test p={p:.3g} not below "
                            f"{th.alpha_each:.3g} yet: more requests needed", numbers)
    return MetricResult("error_rate", "pass", f"error_rate: {rates}, p={p:.3g}", numbers)


def compare_calibration(probes: int, failures: int, th: Thresholds) -> MetricResult:
    """The canary's calibration probes (counts): fail when ``failures`` is more than
    ``th.calibration_max_failures`` of ``probes`` (exactly 2 % passes); insufficient below
    ``th.min_calibration_probes`` probes (with 0 required and none run: pass)."""
    numbers: dict[str, Number] = {"canary_n": probes, "failures": failures,
                                  "failure_rate": failures / probes if probes else None,
                                  "max_failure_rate": th.calibration_max_failures}
    if probes == 0 and th.min_calibration_probes == 0:
        return MetricResult("calibration", "pass", "calibration: no calibration probes",
                            numbers)
    if probes < th.min_calibration_probes:
        return MetricResult("calibration", "insufficient",
                            f"calibration: {probes} probes, "
                            f"{th.min_calibration_probes} needed", numbers)
    # ``failures / probes > share`` in integers-and-epsilon: 1 of 50 is exactly 2 %
    if failures > probes * th.calibration_max_failures + 1e-9:
        return MetricResult("calibration", "fail",
                            f"calibration failed on {failures}/{probes} probes "
                            f"({failures / probes:.1%} > "
                            f"{th.calibration_max_failures:.0%})", numbers)
    return MetricResult("calibration", "pass",
                        f"calibration: {failures}/{probes} probes failed", numbers)


def combine(results: Sequence[MetricResult]) -> Comparison:
    """A step's :class:`Comparison` from its metrics' results (calibration's failure, when
    present, named first: it fails the step whatever the latencies say): ``fail`` when any
    fails, else ``insufficient`` when any lacks samples, else ``inconclusive`` when any is
    (module docstring), else ``pass``."""
    ordered = sorted(results, key=lambda r: r.metric != "calibration")
    for r in ordered:
        if r.decision == "fail":
            return Comparison("fail", r.reason, tuple(results))
    for waiting in ("insufficient", "inconclusive"):
        short = [r for r in results if r.decision == waiting]
        if short:
            return Comparison(waiting, "; ".join(r.reason for r in short), tuple(results))
    return Comparison("pass", "every metric within its thresholds", tuple(results))


def shown_not_gated(m: MetricResult) -> MetricResult:
    """A latency comparison against the previous step's fixed baseline window (the last
    step: the baseline serves nothing), as a pass that shows its numbers: a ``fail`` or
    ``inconclusive`` is not acted on; ``insufficient`` stays (the canary's side still
    fills). That window was taken while each baseline server carried part of the traffic
    the canary's servers now carry all of, so even matched strata compare two loads: a new
    user's trial on 2 + 2 servers saw a good canary rolled back there in 1 of 4 rollouts
    (TTFT P50 x1.15, p = 2.4e-4), ``benchmarks/rollout_e2e.py --fleet 3+3 --steps
    0.1,0.25,0.5,1.0`` in 1 of 6 (P50 x1.28). As in Flagger, whose analysis runs up to the
    canary's highest weight before promotion, the latency verdicts are those of the steps
    with a live baseline."""
    if m.decision not in ("fail", "inconclusive"):
        return m
    return MetricResult(m.metric, "pass", f"{m.reason} (shown, not gated: against the "
                        "previous step's baseline, at another load)", m.numbers)
