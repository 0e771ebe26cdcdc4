"""The config's admin routes (issue 18), guarded like every admin route (``auth.admin_key``,
:mod:`gateway.api.admin`):

* ``GET /admin/config``: the running config (inline keys shown as ``***``) and its version;
* ``POST /admin/config``: a new config as the body, YAML or JSON (JSON is YAML; a body sent
  as ``Content-Type: application/json`` must be valid JSON, its error reported as JSON's
  with line and column), or ``GET /admin/config``'s body posted back (edited):
  ``{"version": N, "config": {...}}`` is read as its ``config``
  (:func:`gateway.reload_input.read_view`); applied live
  (:mod:`gateway.reloading`): 200 with what changed (``applied``, ``version``, ``changed``,
  ``backends_added`` / ``_removed`` / ``_changed``) and ``rollouts``: each entry of the
  config's ``rollouts:``, ``started`` or not, with a ``code`` and the ``reason``
  (:meth:`gateway.flow.rollouts.Rollouts.sync`); 400 in OpenAI's error shape when it is
  not applied (``code``: ``invalid_config``, a body that is not a valid config, ``param``
  the first field named; ``config_refused``, fields that cannot change while the gateway
  runs, each named in the message); 409 ``config_conflict`` (``param`` ``version``) when
  the posted view's ``version`` is not the running one (the change was made on an outdated
  view: read it again); the running config untouched;
* ``GET /admin/config/history``: the kept configs, newest first (version, when, how, digest,
  what changed; ``?config=true`` adds each config, redacted), and ``damaged``: the files of
  the state directory that were not snapshots, moved aside as ``*.damaged`` (file, problem;
  :class:`gateway.config_history.ConfigHistory`);
* ``POST /admin/config/rollback``: ``{"version": N}`` (or no body: the one before the
  running one) applied again as a new version (``source: rollback``).

Fleet mode (``coordination.redis_url``, :mod:`gateway.coord.config_sync`): a change is
published to the shared store and applied by every replica; the history and the rollback
are the fleet's (the configs kept in the store). While the store does not answer, ``POST
/admin/config`` and the rollback answer 503 ``coordination_unavailable`` and change nothing
on any replica (the rule of every fleet-mode admin write, :mod:`gateway.api.admin`); the
history then lists this replica's own kept configs (``"from": "local"``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from gateway.api.admin import _gateway, _store_down
from gateway.api.errors import Refusal
from gateway.config_history import redact
from gateway.reload_errors import ReloadConflict, ReloadRefused, ReloadUnpublished
from gateway.reloading import Reloader

if TYPE_CHECKING:
    from gateway.wiring import Gateway

MAX_BODY_BYTES = 4 << 20
"""The largest config body taken (bytes): a config is kilobytes."""


def _reloader(gw: Gateway) -> Reloader:
    if gw.reloader is None:  # only before the lifespan has started
        raise Refusal(503, "The gateway is starting.", code="starting")
    return gw.reloader


def _refused(gw: Gateway, e: ReloadRefused) -> Refusal:
    if isinstance(e, ReloadUnpublished):
        return _store_down(gw, e.problem)
    if isinstance(e, ReloadConflict):
        return Refusal(409, f"Config not applied (the running config is unchanged): "
                       f"{e.problem}", code="config_conflict", param=e.param)
    code = "config_refused" if e.plan is not None and e.plan.refused else "invalid_config"
    return Refusal(400, f"Config not applied (the running config is unchanged): {e.problem}",
                   code=code, param=e.param)


async def get_config(request: Request) -> JSONResponse:
    gw = _gateway(request)
    last = _reloader(gw).history.last
    return JSONResponse({"version": last.version if last else None,
                         "config": redact(gw.cfg.model_dump(mode="json"))})


async def post_config(request: Request) -> JSONResponse:
    gw = _gateway(request)
    reloader = _reloader(gw)
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise Refusal(413, f"A config body is at most {MAX_BODY_BYTES} bytes.",
                      code="invalid_config")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "The config body is not UTF-8 text (YAML or JSON).",
                      code="invalid_config") from None
    if _is_json(request.headers.get("content-type", "")):
        try:  # said to be JSON: its errors are JSON's, not YAML's (YAML reads it after)
            json.loads(text)
        except json.JSONDecodeError as e:
            gw.metrics.config_reloads.labels("admin", "invalid").inc()
            raise Refusal(400, f"Config not applied (the running config is unchanged): the "
                          f"body is not valid JSON (Content-Type: application/json): "
                          f"{e.msg} at line {e.lineno}, column {e.colno}",
                          code="invalid_config") from None
    try:
        result = await reloader.apply_text(text, "admin")
    except ReloadRefused as e:
        raise _refused(gw, e) from None
    return JSONResponse(result.view())


def _is_json(content_type: str) -> bool:
    """Whether a ``Content-Type`` names JSON (``application/json``, ``application/*+json``;
    RFC 6839 section 3.1), parameters ignored."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def get_history(request: Request) -> JSONResponse:
    gw = _gateway(request)
    reloader = _reloader(gw)
    history = reloader.history
    with_config = request.query_params.get("config", "").lower() in ("1", "true", "yes")
    last = history.last
    snaps = history.snapshots
    source = "local"
    if reloader.fleet is not None:
        try:
            snaps = await reloader.kept()
            source = "store"
        except ReloadUnpublished:
            pass  # the store does not answer: this replica's own
    return JSONResponse({
        "running": last.version if last else None,
        "keep": history.keep,
        "state_dir": str(history.dir) if history.dir is not None else None,
        "fleet": reloader.fleet is not None,
        "from": source,
        "data": [s.view(with_config) for s in reversed(snaps)],
        "damaged": history.damaged_view(),
    })


async def post_rollback(request: Request) -> JSONResponse:
    gw = _gateway(request)
    reloader = _reloader(gw)
    body = await request.body()
    version: Any = None
    if body.strip():
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            raise Refusal(400, "The body must be JSON: {\"version\": N}, or empty: "
                          f"{e.msg} at line {e.lineno}, column {e.colno}.",
                          code="invalid_request", param="version") from None
        except ValueError:
            raise Refusal(400, "The body must be JSON: {\"version\": N}, or empty.",
                          code="invalid_request", param="version") from None
        if isinstance(data, dict) and set(data) - {"version"}:
            extra = sorted(set(data) - {"version"})[0]
            raise Refusal(400, f"Unknown field {extra!r}: the body is {{\"version\": N}} "
                          "or empty.", param=extra, code="invalid_request")
        version = data.get("version") if isinstance(data, dict) else data
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise Refusal(400, "'version' must be an integer (a version of "
                          "GET /admin/config/history) or absent.", param="version",
                          code="invalid_request")
    try:
        result = await reloader.rollback(version)
    except ReloadRefused as e:
        raise _refused(gw, e) from None
    return JSONResponse(result.view())


def install_routes(app: FastAPI) -> None:
    """Add the config routes to ``app``."""
    app.add_api_route("/admin/config", get_config, methods=["GET"], include_in_schema=False)
    app.add_api_route("/admin/config", post_config, methods=["POST"], include_in_schema=False)
    app.add_api_route("/admin/config/history", get_history, methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/admin/config/rollback", post_rollback, methods=["POST"],
                      include_in_schema=False)
