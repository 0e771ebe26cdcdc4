"""A rollout's JSON views (issue 18): ``/admin/rollouts``' snapshot and the state a
resume reads back (:class:`gateway.traffic.rollout.Rollout`'s ``snapshot`` / ``state``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.traffic.rollout_capacity import PoolCapacity
from gateway.traffic.rollout_plan import RolloutPlan, Status, StepRecord, Version
from gateway.traffic.rollout_stats import Comparison


class Rollout(Protocol):
    """What the views read of a :class:`gateway.traffic.rollout.Rollout` (declared here so
    that this module does not import the state machine that imports it)."""

    @property
    def plan(self) -> RolloutPlan: ...
    @property
    def status(self) -> Status: ...
    @property
    def step(self) -> int: ...
    @property
    def share(self) -> float: ...
    @property
    def started_at(self) -> float: ...
    @property
    def step_started_at(self) -> float: ...
    @property
    def served(self) -> Mapping[Version, int]: ...
    @property
    def _step_assigned(self) -> Mapping[Version, int]: ...
    @property
    def canary_share_served(self) -> float: ...
    @property
    def share_before_rollback(self) -> float | None: ...
    @property
    def probes(self) -> int: ...
    @property
    def probe_failures(self) -> int: ...
    @property
    def last_comparison(self) -> Comparison | None: ...
    @property
    def looks(self) -> int: ...
    @property
    def decisive_looks(self) -> int: ...
    @property
    def held(self) -> str | None: ...
    @property
    def capacity(self) -> PoolCapacity | None: ...
    @property
    def prior(self) -> Sequence[Mapping[str, object]]: ...
    @property
    def history(self) -> Sequence[StepRecord]: ...


def snapshot(r: Rollout, now: float) -> dict[str, object]:
    """``/admin/rollouts``' view of rollout ``r`` (JSON-ready): model, versions, status,
    step and share, the step's age (seconds), requests served per version, the canary's
    share served (and before a rollback), calibration probes, the last comparison with
    its numbers, the comparisons made so far (``looks``; ``decisive_looks``: the current
    step's looks whose verdict counted, each spending its share of alpha), ``held``
    (why a passed step waits for the next one's capacity, else None), ``capacity``
    (:meth:`gateway.traffic.rollout_capacity.PoolCapacity.to_json`, None: unknown) and
    the decision history with times."""
    p = r.plan
    return {
        "model": p.model, "baseline": p.baseline, "canary": p.canary,
        "status": r.status, "step": r.step, "steps": list(p.steps),
        "share": r.share, "started_at": r.started_at,
        "step_age_s": now - r.step_started_at if r.status == "running" else None,
        "targeted": r.step < p.targeted_steps and r.status == "running",
        "served": dict(r.served),
        "step_served": dict(r._step_assigned),
        "canary_share_served": r.canary_share_served,
        "share_before_rollback": r.share_before_rollback,
        "calibration": {"probes": r.probes, "failures": r.probe_failures,
                        "measure": p.calibration},
        "comparison": r.last_comparison.to_json() if r.last_comparison else None,
        "looks": r.looks,
        "decisive_looks": r.decisive_looks,
        "held": r.held if r.status == "running" else None,
        "capacity": r.capacity.to_json() if r.capacity else None,
        "history": [*(dict(h) for h in r.prior),
                    *(h.to_json() for h in r.history)],
    }


def state(r: Rollout, now: float) -> dict[str, Any]:
    """What a resume needs (JSON-ready; kept with the config snapshots, issue 18): the
    status, the step and its age (seconds), requests served per version, the share
    before a rollback, the calibration probe counts and the decisions (their ``at``
    made relative: seconds before ``now``, negative)."""
    history: list[dict[str, Any]] = snapshot(r, now)["history"]  # type: ignore[assignment]
    return {
        "status": r.status, "step": r.step,
        "step_age_s": now - r.step_started_at,
        "served": dict(r.served), "share_before_rollback": r.share_before_rollback,
        "probes": r.probes, "probe_failures": r.probe_failures,
        "history": [{**h, "at": float(h["at"]) - now} for h in history],
    }
