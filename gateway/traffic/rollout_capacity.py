"""Whether a rollout step fits the versions' capacity (issue 18; pure: no I/O).

A gateway cannot create servers (Argo Rollouts' ``setCanaryScale: matchTrafficWeight``
scales the canary's ReplicaSet to the traffic weight; here the servers are what the config
lists), so a rollout instead never moves to a step that sends a version more than its
backends can carry: before moving on, :class:`gateway.traffic.rollout.Rollout` asks
:func:`step_hold` and, when it answers a reason, **holds** at the step it passed (no
rollback, no promotion; the reason in ``/admin/rollouts``' ``held`` and one
``gateway_rollout_decisions_total{decision="hold",reason="capacity"}``), and moves on at
the first tick at which the step fits (a live reload added backends of the canary version,
or changed a baseline backend's ``model_version`` to it: both apply in place,
:mod:`gateway.config_diff`; an added backend counts once warm, as it takes traffic).

**Capacity** (:func:`pool_capacity`): each version's routable backends of the model (warm,
breaker not open), each weighed by its configured ``max_num_seqs`` when every one of them
has it, else counted as one. The concurrency the gateway learns from scrapes
(:mod:`gateway.traffic.capacity`) is not used: without a queue it is the most a backend
was seen running, which depends on the traffic it was given, so a canary at 1 % would look
small for being given little and never earn the next step.

**The rule** (:func:`step_hold`), with ``slack`` (the rollout's ``capacity_slack``,
default :data:`CAPACITY_SLACK`, 1.25):

* a step of share ``s < 1``: ``s <= slack x C_canary / (C_baseline + C_canary)``: the
  canary's servers take at most ``slack`` times the model's mean load per unit of capacity
  (the load at which a version's TTFT is that of its build, not of its queue: the confound
  of the e2e benchmark, a 1-of-4 canary at 50 % queueing behind three times each
  baseline server's arrivals). The baseline's share only falls from step to step, so moving
  on never loads it more than the step it is at: it is not checked.
* the last step (``s = 1``, the baseline serves nothing): ``slack x C_canary >=
  C_baseline``: the canary pool carries the whole model at no more than ``slack`` times the
  load per unit of capacity the baseline pool carried before the rollout. (The share rule
  would count the idle baseline servers as the model's capacity and demand that they be
  moved first, while the step before still needs them.) After the promotion the baseline's
  backends serve nothing: move them to the new version by a reload.

``slack`` 1.25: a step may run a version's servers a quarter above the mean load, so a
fleet of 3 + 1 takes the canary to 25 % (31 % allowed) and holds before 50 %; a fleet of
3 + 3 goes through every default step. Tolerance ``1e-9`` on the comparison (shares like
2/5 x 1.25 are not exact in floating point).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

CAPACITY_SLACK = 1.25
"""How far above the model's mean load per unit of capacity a step may run the canary's
servers (module docstring)."""

_EPS = 1e-9

Unit = Literal["max_num_seqs", "backends"]


@dataclass(frozen=True)
class PoolCapacity:
    """The routable capacity of a rollout's two versions: ``baseline`` / ``canary`` in
    ``unit`` (``max_num_seqs``: sequences; ``backends``: a count), and ``backends``
    (routable backends per version)."""

    baseline: float
    canary: float
    unit: Unit
    backends: tuple[int, int] = (0, 0)

    @property
    def canary_share(self) -> float:
        """The canary's share of the two versions' capacity (0.0 when there is none)."""
        total = self.baseline + self.canary
        return self.canary / total if total > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (``/admin/rollouts``' ``capacity``)."""
        return {"baseline": self.baseline, "canary": self.canary, "unit": self.unit,
                "backends": {"baseline": self.backends[0], "canary": self.backends[1]},
                "canary_share": round(self.canary_share, 4)}


def pool_capacity(backends: Iterable[tuple[str | None, int | None]], baseline: str,
                  canary: str) -> PoolCapacity:
    """The capacity of each version from ``(model_version, max_num_seqs or None)`` of the
    model's **routable** backends (the caller filters; module docstring): weighed by
    ``max_num_seqs`` when all of the two versions' backends have it, else counted."""
    seqs: dict[str, list[int | None]] = {baseline: [], canary: []}
    for version, max_num_seqs in backends:
        if version in seqs:
            seqs[version].append(max_num_seqs)
    every = [s for v in seqs.values() for s in v]
    counts = (len(seqs[baseline]), len(seqs[canary]))
    if every and all(s is not None and s > 0 for s in every):
        return PoolCapacity(float(sum(s or 0 for s in seqs[baseline])),
                            float(sum(s or 0 for s in seqs[canary])), "max_num_seqs",
                            counts)
    return PoolCapacity(float(counts[0]), float(counts[1]), "backends", counts)


def step_hold(share: float, cap: PoolCapacity, canary: str,
              slack: float = CAPACITY_SLACK) -> str | None:
    """Why a step of canary share ``share`` (fraction) does not fit ``cap`` (module
    docstring's rule), naming what to do with the canary version ``canary``; None when it
    fits."""
    todo = f"add backends with model_version {canary}"
    if share >= 1.0:
        if slack * cap.canary + _EPS >= cap.baseline:
            return None
        return (f"canary capacity {_amount(cap.canary, cap.unit)} < the baseline's "
                f"{_amount(cap.baseline, cap.unit)} / {slack:g}, needed for step 100 % "
                f"(the canary alone): {todo}")
    if share <= slack * cap.canary_share + _EPS:
        return None
    return (f"canary capacity {cap.canary_share * 100:.0f} % (x{slack:g} = "
            f"{slack * cap.canary_share * 100:.0f} %) < step {share * 100:.0f} %: {todo}")


def _amount(value: float, unit: Unit) -> str:
    if unit == "backends":
        return f"{value:g} backend" + ("" if value == 1 else "s")
    return f"{value:g} sequences"
