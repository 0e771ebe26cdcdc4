"""What a rollout step's comparison calls a regression (issue 18; pure): the
:class:`Thresholds` with each default's reason, spent over a rollout's steps
(:meth:`Thresholds.per_step`) and a step's looks (:meth:`Thresholds.at_look`).
:mod:`gateway.traffic.rollout_stats` decides on them (and re-exports them); a rollout's
``gates`` config (:class:`gateway.config_rollouts.RolloutGates`) sets them per rollout."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["TESTS_COMPARED", "Thresholds"]

TESTS_COMPARED = 3
"""Statistical tests per step (TTFT, ITL, error rate): the Bonferroni divisor of alpha."""


@dataclass(frozen=True)
class Thresholds:
    """What a step's comparison calls a regression. Each default, and why:

    * ``alpha`` 0.01: the chance that the tests roll a good canary back at any step of its
      rollout (family-wise over the three tests and the steps: a rollout of ``k`` steps
      compares each once at ``alpha / k``, :meth:`per_step`, each test at ``alpha / 3k``).
      Before (``alpha`` per step, a failing metric acted on at any look) a good canary was
      rolled back in 2.5-3.3 % of seeded simulated rollouts of the end-to-end benchmark's
      plan (400 seeds, ``benchmarks/rollout.py --profile e2e``), and end to end twice.
      Kayenta's ``MannWhitneyClassifier`` defaults to a 0.95 confidence level per metric;
      we ask 0.99 per rollout because a false rollback costs a release, while a real
      regression of the sizes that matter is far past these levels on a step's sample
      (TTFT x1.5 at sigma 0.5, 100 canary requests against 4000: z ~ 7, p ~ 1e-13).
    * ``p50_tolerance`` 0.10 (unitless ratio - 1): below 10 % at the median, a slowdown is
      within what a cold prefix cache, another GPU in the same pool or a busy host already
      moves, and within the sampling noise of a step's first sample: with a lognormal
      latency (sigma 0.5, ``benchmarks/rollout.py``'s), 40 canary values against 4000
      baseline ones of the same build gave a P50 ratio >= 1.05 in 31 % of 2000 draws,
      >= 1.10 in 16 % (100 values: 21 % and 7 %), so a 5 % gate (the value before) let
      nearly every significant test through, and a good canary was rolled back end to end
      on P50 x1.07 (``benchmarks/rollout_e2e.py``). The size the issue's benchmark must
      catch at its first step is x1.5; x1.25 is caught at the later, larger steps.
    * ``p99_tolerance`` 0.20: twice the median's room, because a P99 read off a few
      hundred requests is set by its few largest values (the same draws: a P99 ratio
      >= 1.1 in 12 %, >= 1.2 in 6 %, at 40 or 100 values).
    * ``error_rate_gate`` 0.005 (fraction of requests, 0.5 percentage points): a smaller
      excess is within the retries' and clients' normal error budget; with a significant
      test, +0.5 points on top of a 0.1 % baseline is already 6x the errors.
    * ``lean_p`` 0.10 (one-sided p-value): an effect over its gate is ``inconclusive``
      (the step waits for samples) only while its test leans toward a regression, p below
      this; at p >= 0.10 the data are well within what no difference gives, and the
      effect over the gate is the noise of a percentile (a P99 read off a few hundred
      values moves by 20-30 %): it passes. Measured end to end: a good canary (ITL P50
      x0.88, P99 x1.28, p = 0.32) was rolled back as inconclusive at ``max_step_s``; the
      trial's slow canary (P50 x1.25, p = 0.056) still waits.
    * ``min_samples`` 30 (samples per side, each latency metric): the normal approximation
      of U is good past 20 per side (scipy's ``mannwhitneyu`` documentation); 30 for margin.
    * ``min_requests`` 100 (requests per side, error rate): the z-test's normal
      approximation wants ``n p >= 5`` on the canary side at the rates it must catch
      (+5 points: 100 x 0.05 = 5; the textbook rule of thumb; below it the exact test).
    * ``calibration_max_failures`` 0.02 (fraction of the canary's probes): the issue's
      rule; exactly 2 % passes, more fails.
    * ``min_calibration_probes`` 10 (probes): one probe is not a rate; with 10, a single
      drifted answer (10 %) already fails. 0 when calibration is off: the metric then passes
      with "no calibration probes".
    * ``overlap_threshold`` 0.8 (token F1): the same answer re-worded in a few places.
    * ``cosine_threshold`` 0.99 (cosine similarity): the same embedding model on another
      build/kernel differs in the 3rd-4th decimal; another model or a bug falls well below.
    """

    alpha: float = 0.01
    p50_tolerance: float = 0.10
    p99_tolerance: float = 0.20
    error_rate_gate: float = 0.005
    lean_p: float = 0.10
    min_samples: int = 30
    min_requests: int = 100
    calibration_max_failures: float = 0.02
    min_calibration_probes: int = 10
    overlap_threshold: float = 0.8
    cosine_threshold: float = 0.99

    def __post_init__(self) -> None:
        for name in ("alpha", "calibration_max_failures", "error_rate_gate", "lean_p",
                     "overlap_threshold", "cosine_threshold"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1.0) or (name == "alpha" and v == 0):
                raise ValueError(f"Thresholds.{name} must be in (0, 1] / [0, 1], got {v!r}")
        for name in ("p50_tolerance", "p99_tolerance"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"Thresholds.{name} must be a finite ratio >= 0, got {v!r}")
        for name in ("min_samples", "min_requests"):
            if getattr(self, name) < 2:
                raise ValueError(f"Thresholds.{name} must be >= 2, got {getattr(self, name)!r}")
        if self.min_calibration_probes < 0:
            raise ValueError("Thresholds.min_calibration_probes must be >= 0, "
                             f"got {self.min_calibration_probes!r}")

    def per_step(self, steps: int) -> Thresholds:
        """These thresholds for one step of a rollout of ``steps`` steps: ``alpha / steps``
        (Bonferroni over the steps; each step is decided once, at its first complete
        comparison, :class:`gateway.traffic.rollout.Rollout`), so that ``alpha`` bounds the
        chance that the tests roll a good canary back at any step of its rollout."""
        return replace(self, alpha=self.alpha / steps)

    def at_look(self, k: int) -> Thresholds:
        """These (one step's) thresholds for the step's ``k``-th decisive look (0-based; a
        look whose verdict is acted on): alpha spent over the looks so that their sum stays
        within the step's alpha however many there are: 3/4 of it at the first look, then
        ``1/4 x 2**-k`` at the ``k``-th later one (1/8, 1/16, ...: a convergent series, the
        idea of alpha spending, Lan & DeMets 1983). A later look is taken only once the
        canary's sample has doubled (:class:`gateway.traffic.rollout.Rollout`), so its
        test has the power its smaller alpha asks for (z grows by about sqrt 2 a
        doubling). Measured: re-testing an inconclusive step every ``recheck_s`` at the
        full alpha rolled back 12 of 400 good canaries (``benchmarks/rollout.py --profile
        e2e --runs 400``)."""
        if k < 0:
            raise ValueError(f"look index must be >= 0, got {k}")
        return replace(self, alpha=self.alpha * (0.75 if k == 0 else 0.25 * 0.5**k))

    @property
    def alpha_each(self) -> float:
        """The per-test significance level: ``alpha / TESTS_COMPARED`` (Bonferroni)."""
        return self.alpha / TESTS_COMPARED
