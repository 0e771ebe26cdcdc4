"""One canary rollout as the gateway runs it (issue 18): :class:`RolloutRun` (its config,
the pure state machine :class:`gateway.traffic.rollout.Rollout`, where it came from), the
machine's plan from a ``rollouts:`` entry (:func:`plan_of`) and the metric label of a
decision's reason (:func:`reason_label`). Used by :mod:`gateway.flow.rollouts`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.config_rollouts import RolloutConfig
from gateway.core.vocab import Prio
from gateway.traffic.rollout import Rollout, RolloutPlan, StepRecord, Version
from gateway.traffic.rollout_stats import Thresholds

Origin = Literal["config", "admin"]

_METRIC_REASON = {"ttft": "ttft", "itl": "itl", "error_rate": "errors",
                  "calibration": "calibration"}


def plan_of(cfg: RolloutConfig, rollout_id: str) -> RolloutPlan:
    """The pure :class:`RolloutPlan` of a validated rollout config (calibration ``off``: no
    probe is required, the calibration metric passes)."""
    cal = cfg.calibration
    t = cfg.targeting
    return RolloutPlan(
        model=cfg.model, baseline=cfg.baseline, canary=cfg.canary, steps=tuple(cfg.steps),
        min_step_s=cfg.min_step_s, min_step_requests=cfg.min_step_requests,
        max_step_s=cfg.max_step_s, recheck_s=cfg.recheck_s,
        on_insufficient=cfg.on_insufficient,
        target_keys=frozenset(t.client_keys),
        target_priorities=frozenset({Prio.LOW}) if t.low_priority else frozenset(),
        targeted_steps=t.steps,
        calibration="exact" if cal.measure == "off" else cal.measure,
        thresholds=Thresholds(min_samples=cfg.min_samples, min_requests=cfg.min_requests,
                              min_calibration_probes=0 if cal.measure == "off"
                              else cal.min_probes,
                              **cfg.gates.model_dump()),  # the gates' names are Thresholds'
        rollout_id=rollout_id, capacity_slack=cfg.capacity_slack,
    )


def reason_label(rec: StepRecord) -> str:
    """The metric label of a decision's reason: ``ok`` (a pass or the promotion),
    ``capacity`` (a passed step held for the next step's capacity), ``operator`` (no
    comparison: an abort), ``insufficient`` (a hold, or a rollback for
    want of samples), else the failing metric (``ttft``, ``itl``, ``errors``,
    ``calibration``)."""
    if rec.cause:
        return rec.cause
    cmp = rec.comparison
    if cmp is None:
        return "operator"
    if rec.outcome in ("pass", "promoted"):
        return "ok"
    for m in cmp.metrics:
        if m.decision == "fail":
            return _METRIC_REASON.get(m.metric, m.metric)
    return "insufficient"


@dataclass
class RolloutRun:
    """One rollout in the gateway: its config, the pure state machine, where it came from
    (``config`` or ``admin``), the config version that started it (None: unknown), the Unix
    time it started, fallbacks per assigned version (requests), when its next calibration
    round is due (monotonic seconds), and how many of its decisions were handled."""

    cfg: RolloutConfig
    rollout: Rollout
    origin: Origin
    config_version: int | None
    started_unix: float
    fallbacks: dict[str, int] = field(default_factory=dict)
    next_probe_at: float = 0.0
    handled: int = 0
    stopped_by_config: bool = False  # rolled back because its config entry went or changed

    def side(self, version: str | None) -> Version | None:
        """``baseline`` / ``canary`` for a ``model_version`` of this rollout, else None."""
        if version == self.cfg.canary:
            return "canary"
        if version == self.cfg.baseline:
            return "baseline"
        return None

    @property
    def running(self) -> bool:
        return self.rollout.status == "running"
