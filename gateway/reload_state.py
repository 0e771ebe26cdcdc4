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
  its config, status, step, decisions).

When it is captured (:class:`gateway.reloading.Reloader`): with each new snapshot (the state
it starts from), again for the running snapshot when the next config replaces it (so a
rollback finds the state as it was when the config was left), every
``reload.checkpoint_s`` while it runs (written only when it changed), and when the gateway
stops.

What :func:`restore` does with it (a backend is matched by id *and* URL: another server
under the same id gets nothing):

* **at start** (the last kept snapshot: a restart): baselines are given back to the
  backends that have none (the reference survives the restart instead of being whatever
  the backend answers first after it), holds are put back with the time they had left, and
  rollouts are taken up where they were (:meth:`gateway.flow.rollouts.Rollouts.restore`);
* **at a rollback** to a kept snapshot: its baselines replace the running ones (the
  reference of the config returned to, not one taken under the config left), its holds are
  put back only on the backends the rollback brings back (a backend kept through the
  rollback keeps the hold an operator gave or released since: holds are operator intent,
  not config), and its rollouts are taken up for models that have none or a fresh one.

In fleet mode the shared store is the fleet's authority for holds and baselines
(:mod:`gateway.coord.operator`): only rollouts are restored from a snapshot there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController
    from gateway.flow.rollouts import Rollouts

log = logging.getLogger("gateway.config")

KEPT_HOLDS = ("admin_drain", "preempted", "gpu_fault")
"""Holds a snapshot keeps (module docstring)."""


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
            "rollouts": rollouts.state() if rollouts is not None else {}}


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
