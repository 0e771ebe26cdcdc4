"""What a new configuration changes against the running one, and whether it can be applied
live (issue 18's live reload). Pure: two validated :class:`gateway.config.GatewayConfig`
in, a :class:`ReloadPlan` out; the applying is :mod:`gateway.reloading`'s.

What applies live (everything else is refused with the dotted path of each field that
differs and "restart the gateway to change it", and the running config stays as it is):

* ``backends``: an id that is new is **added** (``cold``: probed, warmed up and ramped by
  slow start before it takes its share); an id that is gone is **removed** (drained: no new
  requests, in-flight ones finish, then it leaves the fleet); an id kept with other
  settings is **changed** in place when only :data:`LIVE_BACKEND_FIELDS` differ (its
  ``role``, ``max_num_seqs``, its key, its ``model_version``, its ``gpu_hour_price`` and
  ``gpus``: the cost series read them at each scrape). Another field of a kept id
  (its ``url``, ``models``, GPU telemetry, placement) is refused: give the backend a new id
  (one added, the other removed and drained) or restart.
* ``auth``: client keys (added, removed, rotated, new priorities and limits) and the admin
  key: the next request is judged by the new keys (in-flight ones keep what they were
  admitted with); a key whose ``rpm`` / ``tpm`` changed starts with full new buckets.
* ``admission`` (limits): the in-flight bound, queue bound and wait, default rates, the
  token estimate: from the next request (a request admitted or queued keeps its place);
  new default rates start every client's buckets full.
* ``routing.weights``: the ``load_thermal`` policy's next pick scores with them.
* ``rollouts``: a new entry starts a canary rollout, a removed (or changed) one stops it:
  rolled back to its baseline (:meth:`gateway.flow.rollouts.Rollouts.sync`).

Every other section (proxy, lifecycle, thermal, routing's policy, ...) is read by its
component when it is built, so a change there is refused for now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config import BackendConfig, GatewayConfig

LIVE_SECTIONS = frozenset({"auth", "backends", "admission", "routing.weights", "rollouts"})
"""Sections (dotted prefixes) whose every field applies live (``backends`` by the rules
above)."""

LIVE_BACKEND_FIELDS = frozenset({"role", "max_num_seqs", "api_key", "api_key_env",
                                 "api_key_file", "model_version", "gpu_hour_price", "gpus"})
"""A kept backend's fields that change in place."""

RESTART = "restart the gateway to change it"


@dataclass(frozen=True)
class Refusal:
    """One field that cannot change live: its dotted ``path`` and why."""

    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass
class ReloadPlan:
    """What applying a new config does. ``changed``: dotted paths that differ (sorted);
    ``added`` / ``removed`` / ``changed_backends``: backend ids; ``refused``: the fields
    that cannot change live (the plan must not be applied when any)."""

    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed_backends: list[str] = field(default_factory=list)
    auth: bool = False
    refused: list[Refusal] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing refused: the plan may be applied."""
        return not self.refused

    def touches(self, section: str) -> bool:
        """Whether a changed field is in ``section`` (a dotted prefix)."""
        return any(p == section or p.startswith(section + ".") for p in self.changed)

    @property
    def empty(self) -> bool:
        """The new config is the running one."""
        return not self.changed

    def summary(self) -> dict[str, Any]:
        """JSON for the admin API and the history."""
        return {"changed": self.changed, "backends_added": self.added,
                "backends_removed": self.removed, "backends_changed": self.changed_backends,
                "refused": [str(r) for r in self.refused]}


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two ``model_dump()`` trees differ (a list index is a path part;
    lists of different lengths differ as a whole)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in old or k not in new:
                out.append(p)
            else:
                out.extend(differences(old[k], new[k], p))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out.extend(differences(a, b, f"{path}.{i}" if path else str(i)))
        return out
    return [] if old == new else [path or "(top level)"]


def _backend_plan(old: list[BackendConfig], new: list[BackendConfig], plan: ReloadPlan) -> None:
    before = {b.id: b for b in old}
    after = {b.id: b for b in new}
    plan.added = [i for i in after if i not in before]
    plan.removed = [i for i in before if i not in after]
    for i, b in after.items():
        a = before.get(i)
        if a is None:
            continue
        diff = differences(a.model_dump(mode="json"), b.model_dump(mode="json"))
        if not diff:
            continue
        fixed = sorted({d.split(".", 1)[0] for d in diff} - LIVE_BACKEND_FIELDS)
        if fixed:
            plan.refused.extend(
                Refusal(f"backends[{i}].{f}", "a kept backend's " + f + " cannot change live: "
                        "give the backend a new id (the old one is drained and removed, the "
                        "new one added cold) or " + RESTART)
                for f in fixed)
        else:
            plan.changed_backends.append(i)


def plan_reload(old: GatewayConfig, new: GatewayConfig) -> ReloadPlan:
    """The :class:`ReloadPlan` of going from ``old`` (running) to ``new`` (validated)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    plan = ReloadPlan(changed=differences(a, b))
    plan.refused.extend(Refusal(p, RESTART) for p in plan.changed if not live(p))
    if plan.touches("backends"):
        _backend_plan(old.backends, new.backends, plan)
    plan.auth = plan.touches("auth")
    return plan


def live(path: str) -> bool:
    """Whether the field at dotted ``path`` is in a section of :data:`LIVE_SECTIONS`."""
    return any(path == s or path.startswith(s + ".") for s in LIVE_SECTIONS)
