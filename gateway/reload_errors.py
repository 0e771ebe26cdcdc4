"""Why a live reload (issue 18, :mod:`gateway.reloading`) did not apply a config: the
refusals its callers answer (``POST /admin/config`` and ``/admin/config/rollback``: 400,
409 for a conflict, 503 for an unpublished change in fleet mode,
:mod:`gateway.api.config_admin`; SIGHUP and the file watch: logged). Raised by
:class:`gateway.reloading.Reloader` and by fleet mode's :mod:`gateway.reload_fleet`."""

from __future__ import annotations

from gateway.config_diff import ReloadPlan


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
