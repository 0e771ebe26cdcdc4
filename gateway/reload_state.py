"""The state kept with each config snapshot (issue 18: "the last 3 applied configs, with the
state needed to return to them"), captured from and restored to the running gateway.

A snapshot's ``state`` (JSON, :func:`capture`) holds:

* ``calibration``: each backend's calibration baseline (its answers to the calibration
  prompts and the engine endpoint they were taken on: the reference a drift is measured
  against), by backend id, with the URL it was taken at;
* ``holds``: each backend held out of rotation (``admin_drain``, ``preempted``,
  ``gpu_fault``) with the seconds left (None: until released), by id with its URL;
  ``restarting`` holds (waiting for a restart hook's effect) are not kept: they end with
  the restart they wait for;
* ``rollouts``: every model's canary rollout (:meth:`gateway.flow.rollouts.Rollouts.state`:
  its config, status, step, decisions);
* ``ended``: the ended rollouts (:class:`gateway.flow.rollout_ledger.Ledger`: each one's
  outcome, reason and time, and whether it blocks its canary from config starts).

When it is captured (:class:`gateway.reloading.Reloader`): with each new snapshot (the state
it starts from), again for the running snapshot when the next config replaces it (so a
rollback finds the state as it was when the config was left), every
``reload.checkpoint_s`` while it runs (written only when it changed), and when the gateway
stops.

What :func:`restore` does with it (a backend is matched by id *and* URL: another server
under the same id gets nothing):

* **at start** (the last kept snapshot: a restart): baselines are given back to the
  backends that have none (the reference survives the restart instead of being whatever
  the backend answers first after it), holds are put back with the time they had left, the
  ended rollouts are taken up, and rollouts are taken up where they were
  (:meth:`gateway.flow.rollouts.Rollouts.restore`) *before* the config's ``rollouts:``
  entries are started (an entry whose model's rollout is restored, or whose canary
  failed, is then not started again: :meth:`gateway.flow.rollouts.Rollouts.sync`);
* **at a rollback** to a kept snapshot: its baselines replace the running ones (the
  reference of the config returned to, not one taken under the config left), its holds are
  put back only on the backends the rollback brings back (a backend kept through the
  rollback keeps the hold an operator gave or released since: holds are operator intent,
  not config), and its rollouts are taken up for models that have none, a fresh one or
  one that ended without a failure; a failed rollout stays (every request to its
  baseline) and a kept running rollout of a failed canary is not taken up. The ended
  rollouts are the running gateway's, never an older snapshot's.

In fleet mode the shared store is the fleet's authority for holds and baselines
(:mod:`gateway.coord.operator`): only rollouts are restored from a snapshot there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config_history import ConfigHistory, digest

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController
    from gateway.flow.rollouts import Rollouts

log = logging.getLogger("gateway.config")

KEPT_HOLDS = ("admin_drain", "preempted", "gpu_fault")
"""Holds a snapshot keeps (module docstring)."""


class Running(Protocol):
    """What :class:`KeptState` reads of the running gateway (:class:`gateway.wiring
    .Gateway`)."""

    controller: FleetController
    rollouts: Rollouts | None


class KeptState:
    """The state kept with the running snapshot of ``history`` and taken up at a restart,
    for :class:`gateway.reloading.Reloader` (module docstring); ``gw``: the running
    gateway."""

    def __init__(self, history: ConfigHistory, gw: Running) -> None:
        self.history = history
        self.gw = gw
        self.carried_from: int | None = None  # the version whose kept state a start carried

    def start(self, config: dict[str, Any], file_digest: str | None,
              now: float) -> int | None:
        """Record ``config`` (the running one, JSON) as a ``start`` snapshot (``now``: Unix
        seconds) unless the last one kept is that config already (a restart resumed from
        it, or the same file); a new one carries the last one's kept state
        (:meth:`restore_at_start` names that version). Returns the running version (None:
        the history cannot be written, logged)."""
        last = self.history.last
        if last is not None and last.digest == digest(config):
            return last.version
        try:
            snap = self.history.record(config, "start", file_digest, {"changed": []}, now,
                                       state=last.state if last else None)
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)
            return None
        if last is not None and last.state:
            self.carried_from = last.version
        return snap.version

    def restore_at_start(self, phase: str, fleet_mode: bool) -> None:
        """A restart's return to the state kept with the last snapshot (the running config's
        own, or the one before an edited file; :func:`restore`): ``phase`` ``backends``
        (baselines and holds: before the first probe round; not in fleet mode, whose shared
        store keeps them) or ``rollouts`` (the ended rollouts and the rollouts, before the
        config's entries are started).
        Never raises."""
        last = self.history.last
        if last is None or not last.state:
            return
        gw = self.gw
        kept = (f"kept with version {self.carried_from}, carried to version "
                f"{last.version} (this start)" if self.carried_from is not None
                else f"kept with version {last.version}")
        try:
            if phase == "backends":
                if fleet_mode:
                    return
                done = restore(gw.controller, None, last.state, at_start=True)
            else:
                done = restore(None, gw.rollouts, last.state, at_start=True)
        except Exception as e:  # a damaged kept state never stops a start
            log.warning("config: the state %s not restored (%s): %s: %s", kept, phase,
                        type(e).__name__, e)
            return
        if done:
            log.info("config: restored the state %s: %s", kept, ", ".join(done))

    def checkpoint(self) -> None:
        """Keep the running state with the running snapshot (written only when it changed;
        the ``config_checkpoint`` loop, a config change, the gateway's stop). Never
        raises: a state directory that cannot be written is logged."""
        last = self.history.last
        if last is None:
            return
        try:
            self.history.keep_state(last.version, capture(self.gw.controller,
                                                          self.gw.rollouts))
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)


def capture(controller: FleetController, rollouts: Rollouts | None) -> dict[str, Any]:
    """The running gateway's state (module docstring), JSON-ready."""
    now = controller.clock()
    calibration: dict[str, Any] = {}
    holds: dict[str, Any] = {}
    for b in controller.fleet:
        url = b.config.base_url
        if b.calibration_baseline is not None:
            calibration[b.id] = {"url": url, "answers": b.calibration_baseline,
                                 "endpoint": b.calibration_endpoint}
        if b.hold in KEPT_HOLDS:
            left = None if b.hold_until is None else max(0.0, b.hold_until - now)
            holds[b.id] = {"url": url, "kind": b.hold, "left_s": left}
    return {"calibration": calibration, "holds": holds,
            "rollouts": rollouts.state() if rollouts is not None else {},
            "ended": rollouts.ledger.state() if rollouts is not None else []}


def restore(controller: FleetController | None, rollouts: Rollouts | None,
            state: Mapping[str, Any], *, at_start: bool,
            returned: Iterable[str] = ()) -> list[str]:
    """Put ``state`` (:func:`capture`'s) back (module docstring): ``at_start`` a restart's
    rules, else a rollback's (``returned``: the backend ids the rollback brought back). The
    backends' part (baselines, holds) only with ``controller`` (None: fleet mode, or a
    restart's second phase), the rollouts' only with ``rollouts`` (a restart restores the
    backends' part before the first probe round, the rollouts' once the config's have
    been started). A part that does not parse is skipped (logged). Returns what was
    restored, as short phrases for the log."""
    done: list[str] = []
    if controller is not None:
        done += _baselines(controller, state.get("calibration") or {}, replace=not at_start)
        back = None if at_start else set(returned)
        done += _holds(controller, state.get("holds") or {}, back)
    if rollouts is not None:
        ended = state.get("ended") or []
        if at_start and isinstance(ended, list):
            n = rollouts.ledger.load(e for e in ended if isinstance(e, Mapping))
            if n:
                done.append(f"{n} ended rollout(s)")
        saved = state.get("rollouts") or {}
        if isinstance(saved, Mapping):
            done += [f"rollout of {m}" for m in rollouts.restore(saved)]
    return done


def _match(controller: FleetController, saved: Any, backend_id: str) -> Any:
    """The backend ``backend_id`` when it is at the URL ``saved`` names, else None."""
    b = controller.fleet.get(backend_id)
    if b is None or not isinstance(saved, Mapping) or saved.get("url") != b.config.base_url:
        return None
    return b


def _baselines(controller: FleetController, saved: Any, replace: bool) -> list[str]:
    if not isinstance(saved, Mapping):
        return []
    out = []
    for bid, item in saved.items():
        b = _match(controller, item, bid)
        answers = item.get("answers") if b is not None else None
        if b is None or not isinstance(answers, dict):
            continue
        if b.calibration_baseline is not None and (
                not replace or b.calibration_baseline == answers):
            continue
        controller.calibrator.restore_baseline(b, answers, item.get("endpoint"))
        out.append(f"calibration baseline of {bid}")
    return out


def _holds(controller: FleetController, saved: Any, only: set[str] | None) -> list[str]:
    if not isinstance(saved, Mapping):
        return []
    out = []
    now = controller.clock()
    for bid, item in saved.items():
        b = _match(controller, item, bid)
        if b is None or (only is not None and bid not in only) or b.hold is not None:
            continue
        kind, left = item.get("kind"), item.get("left_s")
        if kind not in KEPT_HOLDS or not (left is None or isinstance(left, (int, float))):
            continue
        if kind == "admin_drain":  # through the drain owner: drains a serving one
            controller.drains.start_drain(b, controller.cfg.lifecycle.drain_deadline_s)
        else:
            controller.state.hold(b, kind, None if left is None else now + float(left))
        out.append(f"{kind} hold of {bid}")
    return out
