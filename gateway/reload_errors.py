"""What a live reload (issue 18, :mod:`gateway.reloading`) answers: what it applied
(:class:`ReloadResult`), or why it did not apply a config: the
refusals its callers answer (``POST /admin/config`` and ``/admin/config/rollback``: 400,
409 for a conflict, 503 for an unpublished change in fleet mode,
:mod:`gateway.api.config_admin`; SIGHUP and the file watch: logged). Raised by
:class:`gateway.reloading.Reloader` and by fleet mode's :mod:`gateway.reload_fleet`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config_diff import ReloadPlan
from gateway.config_history import Snapshot


class ReloadRefused(Exception):
    """A new config that is not applied: invalid (``problem``, and ``param`` the field at
    fault when one is: the admin API's ``param``), or with fields that cannot change live
    (``plan.refused``). Nothing changed."""

    def __init__(self, problem: str, plan: ReloadPlan | None = None,
                 param: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.plan = plan
        self.param = param


class ReloadConflict(ReloadRefused):
    """``GET /admin/config``'s view posted back with a ``version`` that is not the running
    one: the change was made on an outdated view (``POST /admin/config``'s 409)."""


class ReloadUnpublished(ReloadRefused):
    """Fleet mode: the shared store did not take the change (``problem``): applied nowhere."""


@dataclass
class ReloadResult:
    """An applied (or unchanged) config: its snapshot (None when nothing changed) and the
    plan."""

    plan: ReloadPlan
    snapshot: Snapshot | None
    added: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)
    rollouts: list[dict[str, Any]] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """JSON for the admin API: ``applied``, ``unchanged``, ``version``, what changed
        and ``rollouts``: each ``rollouts:`` entry of the config, started or not and why
        (:meth:`gateway.flow.rollouts.Rollouts.sync`)."""
        s = self.snapshot
        return {"applied": s is not None, "unchanged": self.plan.empty,
                "version": s.version if s else None, **self.plan.summary(),
                "rollouts": self.rollouts}
