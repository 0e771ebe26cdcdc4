"""A rollout's saved state read back (pure; issue 18, "Snapshots"): what
:meth:`gateway.traffic.rollout.Rollout.state` wrote, checked and made absolute again, for
:meth:`gateway.traffic.rollout.Rollout.resume` (a restart, a config rollback)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.traffic.rollout_plan import Status, Version


@dataclass(frozen=True)
class Resumed:
    """A checked saved state: the status, the step, when it started (the injected clock,
    seconds: ``now`` less its saved age), requests served per version, the share before a
    rollback, calibration probes and failures (counts) and the decisions so far (JSON,
    ``at`` on the injected clock)."""

    status: Status
    step: int
    step_started_at: float
    served: dict[Version, int]
    share_before_rollback: float | None
    probes: int
    probe_failures: int
    prior: list[dict[str, object]]


def parse_state(state: Mapping[str, Any], steps: int, now: float) -> Resumed:
    """``state`` (:meth:`gateway.traffic.rollout.Rollout.state`'s dict) of a plan of
    ``steps`` steps, taken up at ``now``. Raises ``KeyError`` / ``ValueError`` /
    ``TypeError`` for a state that is not one."""
    status = state["status"]
    if status not in ("running", "promoted", "rolled_back"):
        raise ValueError(f"rollout status {status!r}")
    step = int(state["step"])
    if not 0 <= step < steps:
        raise ValueError(f"rollout step {step} of {steps}")
    served = state.get("served") or {}
    history = state.get("history") or []
    if not isinstance(served, Mapping) or not isinstance(history, list):
        raise TypeError("rollout state: served must be an object, history a list")
    sb = state.get("share_before_rollback")
    return Resumed(
        status=status, step=step,
        step_started_at=now - max(0.0, float(state.get("step_age_s") or 0.0)),
        served={"baseline": int(served.get("baseline", 0)),
                "canary": int(served.get("canary", 0))},
        share_before_rollback=None if sb is None else float(sb),
        probes=int(state.get("probes") or 0),
        probe_failures=int(state.get("probe_failures") or 0),
        prior=[{**r, "at": now + float(r["at"])} for r in history])
