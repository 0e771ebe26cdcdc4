"""The ended rollouts (issue 18): every rollout that rolled back or was promoted, kept after
it leaves the rollouts table (replaced by another rollout of the model, cleared, or lost
to a config rollback), so that ``GET /admin/rollouts`` shows every decision with its time
and reason, and so that no config apply starts again a canary that has already failed.

**The identity rule.** A rollout's identity is ``(model, baseline, canary)``: the versions
being compared, not the step settings (``steps``, ``min_step_s``, ...). A canary that
failed against a baseline failed whatever the pace of the rollout that found it: an entry
that differs only in its settings is the same canary again.

**What blocks.** An :class:`Ended` record *blocks* its identity when the rollout rolled
back on a failed comparison (TTFT, ITL, errors, calibration, too few samples at
``max_step_s``) or by an operator's abort (``POST /admin/rollouts/{model}/abort``). A
rollout stopped because its config entry was removed or changed does not block (that is
no verdict on the canary), nor does a promotion. While a blocking record stands, applying
a config (``POST /admin/config``, SIGHUP, the watch, a rollback of either kind, another
replica's config in fleet mode, a restart) never starts that identity's ``rollouts:``
entry, and a rollback never takes up a running rollout of it from a kept snapshot: the
config's rollback returns to the baseline version *and* the previous snapshot. The
operator lifts the block explicitly: ``DELETE /admin/rollouts/{model}`` (the ended
rollout and the model's blocks are cleared; the next apply of a config with the entry
starts it) or ``POST /admin/rollouts`` with that identity (a deliberate new start).

The records are kept with every config snapshot's state (``ended``,
:mod:`gateway.reload_state`); a restart takes them up from the last snapshot, a rollback
keeps the running gateway's (they are never replaced by an older snapshot's). At most
:data:`KEEP` are kept, newest last; a blocking record is dropped only when more than
:data:`KEEP` blocking ones exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config_rollouts import RolloutConfig
    from gateway.flow.rollout_run import RolloutRun

KEEP = 20
"""Ended rollouts kept (records): a page of recent history; the oldest beyond it drop
(non-blocking ones first)."""

Identity = tuple[str, str, str]
"""``(model, baseline, canary)``: a rollout's identity (module docstring)."""


@dataclass(frozen=True)
class Ended:
    """One ended rollout: its ``id``, identity, ``origin`` (``config`` / ``admin``), the
    config version that started it (None: none), ``status`` (``rolled_back`` /
    ``promoted``), the deciding ``reason`` and its metric label ``label`` (``ok``,
    ``ttft``, ``itl``, ``errors``, ``calibration``, ``insufficient``, ``operator``), the
    step it ended at, ``started_unix`` and ``ended_unix`` (Unix seconds), whether it
    ``blocks`` its identity (module docstring) and, once the operator lifted that,
    ``cleared_unix`` and ``cleared_by``."""

    id: str
    model: str
    baseline: str
    canary: str
    origin: str
    config_version: int | None
    status: str
    reason: str
    label: str
    step: int
    started_unix: float
    ended_unix: float
    blocks: bool
    cleared_unix: float | None = None
    cleared_by: str | None = None

    @property
    def identity(self) -> Identity:
        return (self.model, self.baseline, self.canary)

    @property
    def blocking(self) -> bool:
        """Whether it blocks its identity now (not cleared)."""
        return self.blocks and self.cleared_unix is None


class Ledger:
    """The ended rollouts (module docstring), oldest first."""

    def __init__(self) -> None:
        self.records: list[Ended] = []

    def add(self, rec: Ended) -> None:
        """Keep ``rec`` (a rollout that just ended; one with the same ``id`` is replaced)."""
        self.records = [r for r in self.records if r.id != rec.id] + [rec]
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest beyond :data:`KEEP`, non-blocking ones first."""
        while len(self.records) > KEEP:
            drop = next((r for r in self.records if not r.blocking), self.records[0])
            self.records.remove(drop)

    def blocking(self, identity: Identity) -> Ended | None:
        """The newest record that blocks ``identity`` now, or None."""
        return next((r for r in reversed(self.records)
                     if r.blocking and r.identity == identity), None)

    def blocks_run(self, rollout_id: str) -> bool:
        """Whether the ended rollout ``rollout_id`` blocks its identity now."""
        return any(r.id == rollout_id and r.blocking for r in self.records)

    def clear(self, now_unix: float, by: str, model: str,
              identity: Identity | None = None) -> list[str]:
        """Lift the blocks of ``model`` (only ``identity``'s when given), recording when
        (``now_unix``, Unix seconds) and ``by`` what. Returns the ids cleared."""
        out: list[str] = []
        recs = []
        for r in self.records:
            if r.blocking and r.model == model and identity in (None, r.identity):
                r = replace(r, cleared_unix=now_unix, cleared_by=by)
                out.append(r.id)
            recs.append(r)
        self.records = recs
        return out

    def state(self) -> list[dict[str, Any]]:
        """JSON-ready records (kept with the config snapshots)."""
        return [asdict(r) for r in self.records]

    def load(self, saved: Iterable[Mapping[str, Any]]) -> int:
        """Take up saved records (:meth:`state`) not known here (by id); one that does not
        parse is skipped. Returns how many were taken up."""
        known = {r.id for r in self.records}
        n = 0
        for item in saved:
            try:
                rec = Ended(**item)
            except TypeError:
                continue
            if rec.id not in known:
                self.records.append(rec)
                known.add(rec.id)
                n += 1
        self.records.sort(key=lambda r: r.ended_unix)
        self._trim()
        return n

    def view(self) -> list[dict[str, Any]]:
        """``GET /admin/rollouts``' ``ended``: newest first, each with ``blocking`` (now)."""
        return [{**asdict(r), "blocking": r.blocking} for r in reversed(self.records)]


def identity_of(model: str, baseline: str, canary: str) -> Identity:
    """A rollout's identity (module docstring)."""
    return (model, baseline, canary)


def why_not_started(have: RolloutRun | None, c: RolloutConfig,
                    ledger: Ledger) -> tuple[str | None, str]:
    """Why the config entry ``c`` is not started now (:meth:`gateway.flow.rollouts.Rollouts
    .sync`; ``have``: the model's rollout, if any): a code and a reason that says what
    starts it, or ``(None, "")`` when it starts."""
    model = c.model
    if have is not None and have.cfg == c and have.running:
        return "running", f"rollout {have.rollout.plan.rollout_id} of the entry runs"
    blocked = ledger.blocking(identity_of(model, c.baseline, c.canary))
    if blocked is not None:
        return "rolled_back", (
            f"canary {c.canary} rolled back against {c.baseline} (rollout {blocked.id}, "
            f"{blocked.label}: {blocked.reason}); a canary that failed is not started "
            f"again by a config: DELETE /admin/rollouts/{model} lifts that, then apply "
            "the config again (or POST /admin/rollouts)")
    if have is not None and have.cfg == c:
        return have.rollout.status, (
            f"the entry's rollout {have.rollout.plan.rollout_id} ended "
            f"({have.rollout.status}); DELETE /admin/rollouts/{model} forgets it, then "
            "apply the config again to run it again")
    if have is not None and have.running:
        return "admin_running", (
            f"rollout {have.rollout.plan.rollout_id} started by the admin API runs "
            f"(from {have.cfg.baseline} to {have.cfg.canary}); abort it first "
            f"(POST /admin/rollouts/{model}/abort), then apply the config again")
    return None, ""
