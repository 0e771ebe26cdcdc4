"""The canary rollouts' admin routes (issue 18), guarded like every admin route
(``auth.admin_key``, :mod:`gateway.api.admin`):

* ``GET /admin/rollouts``: ``{"data": [...], "ended": [...]}``: ``ended`` lists the recent
  ended rollouts, newest first, each with its outcome, reason, time and whether it blocks
  its canary from config starts (:mod:`gateway.flow.rollout_ledger`: kept after the
  rollout leaves ``data``, replaced or cleared); ``data`` each rollout's snapshot
  (:meth:`gateway.flow.rollouts.Rollouts.view`: status, step and shares, requests served per
  version and the canary's share, calibration probes, the last comparison with its numbers,
  every decision with its time, fallbacks, where it came from); times on the wall clock
  (:func:`wall_times`: ``started_at`` and each decision's ``at`` in ISO 8601 UTC,
  ``started_unix`` and ``at_unix`` in Unix seconds; the monotonic clock the decisions are
  made on is the state machine's own);
* ``POST /admin/rollouts``: start one; the body is a JSON object with the fields of a
  ``rollouts:`` entry (:class:`gateway.config_rollouts.RolloutConfig`). 201 with its
  snapshot; 400 in OpenAI's error shape (``code: invalid_rollout``, ``param`` the field)
  for a body that is not a valid rollout or names a version no backend of the model has;
  409 (``rollout_running``) when one runs for the model. Not written to the config: a
  rollout started here is not in the config history, and its rollback returns no config;
* ``POST /admin/rollouts/{model}/abort``: the operator's rollback (every request of the
  model to the baseline from now on; ``{"reason": "..."}`` optional); 409 when it has
  ended, 404 when there is none.
* ``DELETE /admin/rollouts/{model}``: forget an ended rollout (its last routing: all to the
  baseline, or all to the canary), the model routed as without a rollout again, and lift
  the model's blocks (a config entry of a canary that failed starts at the next apply of
  the config: the operator's explicit ask); 409 while it runs, 404 when there is neither
  a rollout nor a block.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse

from gateway.api.admin import _gateway
from gateway.api.errors import Refusal
from gateway.config_rollouts import RolloutConfig, key_problem

if TYPE_CHECKING:
    from gateway.flow.rollouts import Rollouts
    from gateway.wiring import Gateway

MAX_BODY_BYTES = 64 << 10
"""The largest rollout body taken (bytes)."""


def _rollouts(gw: Gateway) -> Rollouts:
    if gw.rollouts is None:  # only before the lifespan has started
        raise Refusal(503, "The gateway is starting.", code="starting")
    return gw.rollouts


async def _json(request: Request) -> object:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise Refusal(413, f"A rollout body is at most {MAX_BODY_BYTES} bytes.",
                      code="invalid_rollout")
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:  # JSON's own error, where it is
        raise Refusal(400, f"The body must be a JSON object: not valid JSON: {e.msg} at line "
                      f"{e.lineno}, column {e.colno}.", code="invalid_rollout") from None
    except ValueError:  # not UTF-8
        raise Refusal(400, "The body must be a JSON object.", code="invalid_rollout") from None


def iso_utc(unix_s: float) -> str:
    """Unix seconds as ISO 8601 UTC (``2026-12-03T06:30:00.123+00:00``)."""
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds")


def wall_times(view: dict[str, Any]) -> dict[str, Any]:
    """A rollout's snapshot (:meth:`gateway.flow.rollouts.Rollouts.view`) with its times
    for people: ``started_at`` (the state machine's monotonic seconds there) from
    ``started_unix`` and each decision's ``at`` from its ``at_unix``, in ISO 8601 UTC."""
    history = [{**h, "at": iso_utc(h["at_unix"])} for h in view.get("history") or []]
    return {**view, "started_at": iso_utc(view["started_unix"]), "history": history}


def _views(rollouts: Rollouts) -> list[dict[str, Any]]:
    return [wall_times(v) for v in rollouts.view()]


async def list_rollouts(request: Request) -> JSONResponse:
    rollouts = _rollouts(_gateway(request))
    ended = [{**e, "started_at": iso_utc(e["started_unix"]), "ended_at": iso_utc(e["ended_unix"])}
             for e in rollouts.ledger.view()]
    return JSONResponse({"data": _views(rollouts), "ended": ended})


async def start_rollout(request: Request) -> JSONResponse:
    gw = _gateway(request)
    rollouts = _rollouts(gw)
    data = await _json(request)
    if not isinstance(data, dict):
        raise Refusal(400, "The body must be a JSON object with the fields of a rollouts: "
                      "entry (model, baseline, canary, ...).", code="invalid_rollout")
    try:
        cfg = RolloutConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = "unknown field (check the spelling)" if first["type"] == "extra_forbidden" \
            else first["msg"]
        raise Refusal(400, f"Invalid rollout: {param or '(body)'}: {msg}", param=param,
                      code="invalid_rollout") from None
    problem = rollouts.version_problem(cfg) or key_problem(
        cfg, (k.name for k in gw.cfg.auth.client_keys))
    if problem is not None:
        raise Refusal(400, f"Invalid rollout: {problem}", param=problem.split(":", 1)[0],
                      code="invalid_rollout")
    run = rollouts.runs.get(cfg.model)
    if run is not None and run.running:
        raise Refusal(409, f"A rollout of {cfg.model!r} is running (step {run.rollout.step}); "
                      f"abort it first: POST /admin/rollouts/{cfg.model}/abort",
                      param="model", code="rollout_running")
    rollouts.start(cfg, "admin")
    view = next(v for v in _views(rollouts) if v["model"] == cfg.model)
    return JSONResponse(view, status_code=201)


async def abort_rollout(model: str, request: Request) -> JSONResponse:
    gw = _gateway(request)
    rollouts = _rollouts(gw)
    data = await _json(request)
    if data is not None and not isinstance(data, dict):
        raise Refusal(400, 'The body must be a JSON object ({"reason": "..."}) or empty.',
                      code="invalid_rollout")
    reason = (data or {}).get("reason")
    if reason is not None and not isinstance(reason, str):
        raise Refusal(400, f"reason must be a string, not {type(reason).__name__}.",
                      param="reason", code="invalid_rollout")
    text = "operator: aborted" + (f": {reason}" if reason else "")
    if rollouts.abort(model, text) is None:
        _not_running(rollouts, model)
    view = next(v for v in _views(rollouts) if v["model"] == model)
    return JSONResponse(view)


def _not_running(rollouts: Rollouts, model: str) -> None:
    """Raise the refusal for a model whose rollout is not running: 409 ``rollout_ended``
    when it ended (saying how to clear it), 404 ``rollout_not_found`` when there is none."""
    run = rollouts.runs.get(model)
    if run is not None:
        raise Refusal(409, f"The rollout of {model!r} has already ended "
                      f"({run.rollout.status}); DELETE /admin/rollouts/{model} clears it.",
                      param="model", code="rollout_ended")
    raise Refusal(404, f"No rollout of {model!r} is running.", param="model",
                  code="rollout_not_found")


async def clear_rollout(model: str, request: Request) -> JSONResponse:
    gw = _gateway(request)
    rollouts = _rollouts(gw)
    try:
        run, lifted = rollouts.clear(model)
    except ValueError as e:
        raise Refusal(409, f"{e} (POST /admin/rollouts/{model}/abort).", param="model",
                      code="rollout_running") from None
    if run is None and not lifted:
        raise Refusal(404, f"No rollout of {model!r} to clear.", param="model",
                      code="rollout_not_found")
    return JSONResponse({"model": model,
                         "cleared": run.rollout.plan.rollout_id if run else None,
                         "status": run.rollout.status if run else None,
                         "unblocked": lifted})


def install_routes(app: FastAPI) -> None:
    """Add the rollout routes to ``app``."""
    app.add_api_route("/admin/rollouts", list_rollouts, methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/admin/rollouts", start_rollout, methods=["POST"],
                      include_in_schema=False)
    app.add_api_route("/admin/rollouts/{model:path}/abort", abort_rollout, methods=["POST"],
                      include_in_schema=False)
    app.add_api_route("/admin/rollouts/{model:path}", clear_rollout, methods=["DELETE"],
                      include_in_schema=False)
