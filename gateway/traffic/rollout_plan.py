"""What a canary rollout is asked to do and what it records (pure; issue 18): the plan
(:class:`RolloutPlan`: the versions, the steps, the times and samples a step needs, the
targeting, the thresholds), a decision (:class:`StepRecord`) and the session hash that keeps
a session on one version (:func:`unit_hash`). The state machine that runs a plan:
:mod:`gateway.traffic.rollout`."""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.vocab import Prio
from gateway.traffic.calibration_match import CalibrationMeasure
from gateway.traffic.rollout_capacity import CAPACITY_SLACK
from gateway.traffic.rollout_stats import Comparison, Thresholds

Version = Literal["baseline", "canary"]
Status = Literal["running", "promoted", "rolled_back"]
StepOutcome = Literal["pass", "hold", "promoted", "rolled_back"]
"""A recorded decision: the step passed, held (past ``max_step_s``, or passed and waiting
for the next step's capacity: ``cause="capacity"``), the rollout promoted or
rolled back (a failed comparison is recorded as ``rolled_back``, its comparison attached)."""

DEFAULT_STEPS: tuple[float, ...] = (0.01, 0.05, 0.25, 0.5, 1.0)
"""The canary's share of the model's traffic at each step (the issue's default)."""


@dataclass(frozen=True)
class RolloutPlan:
    """What a rollout does (the lead's config / ``POST /admin/rollouts`` maps onto it).

    ``model``: the model name clients ask for; ``baseline`` / ``canary``: the two
    ``model_version`` values. ``steps``: canary shares (fractions of the model's traffic),
    strictly increasing in (0, 1], ending at 1.0. ``min_step_s`` (seconds, 300: several
    calibration rounds and long enough for a cold prefix cache to warm) and
    ``min_step_requests`` (canary requests observed, 100: the error test's ``min_requests``)
    must both be met before a step is compared; ``max_step_s`` (seconds, 3600) ends a step
    whose comparison is still ``insufficient`` by ``on_insufficient`` (module docstring);
    ``recheck_s`` (seconds, 10): how often an insufficient comparison is retried.
    ``target_keys`` / ``target_priorities`` / ``targeted_steps``: the first
    ``targeted_steps`` steps only for those requests. ``calibration``: the match measure of
    a probe. ``max_window_samples`` (samples per side and latency metric, 10 000): a
    uniform reservoir (Vitter's algorithm R) bounds the memory and a comparison's sort.
    ``rollout_id``: salts the session hash, so successive rollouts start different sessions
    on their canaries. ``capacity_slack`` (1.25): how far above the model's mean load per
    unit of capacity a step may run the canary's servers
    (:mod:`gateway.traffic.rollout_capacity`).
    """

    model: str
    baseline: str
    canary: str
    steps: tuple[float, ...] = DEFAULT_STEPS
    min_step_s: float = 300.0
    min_step_requests: int = 100
    max_step_s: float = 3600.0
    recheck_s: float = 10.0
    on_insufficient: Literal["rollback", "hold"] = "rollback"
    target_keys: frozenset[str] = frozenset()
    target_priorities: frozenset[Prio] = frozenset()
    targeted_steps: int = 0
    calibration: CalibrationMeasure = "exact"
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_window_samples: int = 10_000
    rollout_id: str = ""
    capacity_slack: float = CAPACITY_SLACK

    def __post_init__(self) -> None:
        s = self.steps
        if not s or any(not (0.0 < x <= 1.0) for x in s) or s[-1] != 1.0 or any(
            b <= a for a, b in itertools.pairwise(s)
        ):
            raise ValueError("RolloutPlan.steps must be strictly increasing shares in (0, 1] "
                             f"ending at 1.0, got {list(s)!r}")
        for name, ok, need in (
            ("min_step_s", math.isfinite(self.min_step_s) and self.min_step_s >= 0, ">= 0 s"),
            ("max_step_s", math.isfinite(self.max_step_s)
             and self.max_step_s >= self.min_step_s, ">= min_step_s"),
            ("min_step_requests", self.min_step_requests >= 1, ">= 1"),
            ("recheck_s", math.isfinite(self.recheck_s) and self.recheck_s > 0, "> 0 s"),
            ("capacity_slack", math.isfinite(self.capacity_slack)
             and self.capacity_slack >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"RolloutPlan.{name} must be {need}, "
                                 f"got {getattr(self, name)!r}")
        if not 0 <= self.targeted_steps < len(s):
            raise ValueError("RolloutPlan.targeted_steps must be in [0, len(steps) - 1] (the "
                             f"last step is for everyone), got {self.targeted_steps!r}")
        if self.targeted_steps and not (self.target_keys or self.target_priorities):
            raise ValueError("RolloutPlan.targeted_steps needs target_keys or "
                             "target_priorities")
        if self.max_window_samples < self.thresholds.min_samples:
            raise ValueError("RolloutPlan.max_window_samples must be >= "
                             f"thresholds.min_samples, got {self.max_window_samples!r}")
        if self.baseline == self.canary:
            raise ValueError("RolloutPlan.canary must differ from baseline, "
                             f"both are {self.canary!r}")


@dataclass(frozen=True)
class StepRecord:
    """One decision of the rollout: ``at`` (the injected clock, seconds), the step index and
    share, the ``outcome`` and its ``reason``, the comparison it rests on (None for an
    operator's rollback), and its ``cause`` (``capacity`` for a hold for want of the
    next step's capacity, ``inconclusive`` for a rollback or hold at ``max_step_s`` on an
    inconclusive comparison, else empty; ``gateway_rollout_decisions_total``'s reason)."""

    at: float
    step: int
    share: float
    outcome: StepOutcome
    reason: str
    comparison: Comparison | None = None
    cause: str = ""

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {"at": self.at, "step": self.step, "share": self.share,
                "outcome": self.outcome, "reason": self.reason, "cause": self.cause,
                "comparison": self.comparison.to_json() if self.comparison else None}


def unit_hash(salt: str, key: str) -> float:
    """A stable point in [0, 1) for ``key`` (BLAKE2b, the same in every process)."""
    digest = hashlib.blake2b(f"{salt}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
