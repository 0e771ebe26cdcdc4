"""Zones and spot notices on the admin surface (``/admin/zones``), guarded by
``auth.admin_key`` like every admin route (:mod:`gateway.api.admin`).

* ``GET /admin/zones``: each zone's spot health score (:mod:`gateway.routing.spot`) and its
  backends (id, capacity type, node, instance type, state, hold); backends without a zone
  are listed under ``"zone": null``.
* ``POST /admin/zones/{zone}/notice``: a spot interruption notice for anything the node watch
  does not see (:mod:`gateway.fleet.spot`). Optional JSON body ``{"node": ..., "instance_type":
  ..., "reason": ...}`` (strings; ``reason`` defaults to ``admin``). With ``node``, the
  backends on that node are preempted (``lifecycle.preempt_deadline_s`` drain, then held
  out); without, only the zone's score drops. Answers 202 with what it did (``preempted``,
  ``score_before``, ``score``, the zone's backends), or 200 with ``"repeat": true`` when the
  node was already noticed within ``lifecycle.preempt_hold_s`` (not counted, the score
  unchanged; only the node's backends back in rotation since, e.g. undrained, are preempted
  again, listed in ``preempted``; in fleet mode ``fleet.notice_id`` is then null). 404 for a
  zone no backend is in; 400 for an unknown field, a field that is not a non-empty string,
  or a node whose backends are in another zone. In fleet mode the notice is applied by every
  replica (:mod:`gateway.coord.notices`; preemption through the operator's op records) and
  the answer carries ``fleet``; while the store does not answer it is refused (503
  ``coordination_unavailable``), like every admin write.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.api.admin import _fleet_writes, _gateway, _options, _store_down
from gateway.api.errors import Refusal
from gateway.coord.link import CoordinationUnavailable
from gateway.fleet.backend import Backend
from gateway.fleet.discovery import SpotNotice
from gateway.fleet.drain import Drains
from gateway.fleet.spot import NoticeOutcome

if TYPE_CHECKING:
    from gateway.wiring import Gateway

_FIELDS = frozenset({"node", "instance_type", "reason"})
MAX_TEXT = 253  # a Kubernetes node name (a DNS subdomain) is at most 253 characters


def _text(opts: dict[str, Any], key: str) -> str | None:
    """``opts[key]``: a non-empty string of at most :data:`MAX_TEXT` characters, or None when
    absent (or null); 400 naming ``key`` otherwise."""
    value = opts.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT:
        raise Refusal(
            400,
            f"'{key}' must be a non-empty string of at most {MAX_TEXT} characters.",
            param=key,
            code="invalid_value",
        )
    return value.strip()


def _backend_view(b: Backend) -> dict[str, Any]:
    p = b.placement
    return {
        "id": b.id,
        "capacity_type": p.capacity_type,
        "node": p.node,
        "instance_type": p.instance_type,
        "state": b.state.value,
        "hold": b.hold,
    }


def zones_summary(gw: Gateway) -> list[dict[str, Any]]:
    """Each zone (sorted; backends without a zone last, as ``null``) with its score (None
    for ``null``) and its backends in fleet order. Zones with a score below 1 but no
    backend now are listed too (a discovered fleet changes)."""
    now = gw.controller.clock()
    by_zone: dict[str | None, list[Backend]] = {}
    for b in gw.fleet:
        by_zone.setdefault(b.placement.zone, []).append(b)
    for z in gw.spot.scores.snapshot(now):
        by_zone.setdefault(z, [])
    named = sorted(z for z in by_zone if z is not None)
    out = [
        {
            "zone": z,
            "score": round(gw.spot.scores.score(z, now), 4),
            "backends": [_backend_view(b) for b in by_zone[z]],
        }
        for z in named
    ]
    if None in by_zone:
        out.append({"zone": None, "score": None,
                    "backends": [_backend_view(b) for b in by_zone[None]]})
    return out


async def list_zones(request: Request) -> Response:
    """``GET /admin/zones``: the spot settings and every zone (:func:`zones_summary`)."""
    gw = _gateway(request)
    s = gw.cfg.spot
    return JSONResponse({
        "spot": {"notice_penalty": s.notice_penalty, "half_life_s": s.half_life_s,
                 "min_score": s.min_score},
        "zones": zones_summary(gw),
    })


def _answer(gw: Gateway, out: NoticeOutcome, fleet: dict[str, Any] | None) -> Response:
    zone = next((z for z in zones_summary(gw) if z["zone"] == out.zone), None)
    body: dict[str, Any] = {
        "zone": out.zone,
        "node": out.node,
        "instance_type": out.instance_type,
        "reason": out.reason,
        "repeat": out.repeat,
        "score_before": None if out.score_before is None else round(out.score_before, 4),
        "score": None if out.score is None else round(out.score, 4),
        "half_life_s": gw.cfg.spot.half_life_s,
        "preempted": list(out.preempted),
        "on_node": list(out.on_node),
        "backends": [] if zone is None else zone["backends"],
    }
    if fleet is not None:
        body["fleet"] = fleet
    return JSONResponse(body, status_code=200 if out.repeat else 202)


async def zone_notice(zone: str, request: Request) -> Response:
    """``POST /admin/zones/{zone}/notice`` (module docstring)."""
    gw = _gateway(request)
    opts = await _options(request, _FIELDS)
    node = _text(opts, "node")
    notice = SpotNotice(zone, node, _text(opts, "instance_type"), _text(opts, "reason") or "admin")
    known = {b.placement.zone for b in gw.fleet} | set(gw.spot.scores.snapshot())
    if zone not in known:
        names = ", ".join(sorted(z for z in known if z is not None)) or "none"
        raise Refusal(
            404,
            f"No backend is in zone '{zone}' (zones: {names}).",
            param="zone",
            code="zone_not_found",
        )
    on_node = gw.spot.on_node(node)
    elsewhere = [b for b in on_node if b.placement.zone not in (None, zone)]
    if elsewhere:
        b = elsewhere[0]
        raise Refusal(
            400,
            f"Node '{node}' is in zone '{b.placement.zone}' (backend '{b.id}'), not '{zone}'.",
            param="node",
            code="invalid_value",
        )
    ops = _fleet_writes(gw)  # fleet mode; 503 while the store does not answer
    if ops is None or gw.shared_notices is None:
        return _answer(gw, gw.spot.notice(notice), None)
    lc = gw.cfg.lifecycle
    preempted: list[str] = []
    repeat = gw.spot.is_repeat(node)
    try:  # each step is idempotent: a notice retried after a 503 finishes what is left
        # a repeat too: a backend undrained since the first notice is preempted again
        for b in on_node:
            if Drains.would_start_drain(b, preempt=True):
                await ops.submit(b, "preempt", lc.preempt_deadline_s, lc.preempt_hold_s)
                preempted.append(b.id)
        if repeat:  # not shared again: every replica applied the first one
            rec, out = None, gw.spot.notice(notice, preempt=False)
        else:
            rec, out = await gw.shared_notices.submit(notice)
    except CoordinationUnavailable as e:
        raise _store_down(gw, str(e)) from None
    assert gw.coord is not None
    fleet = {
        "accepted": "fleet-wide",
        "notice_id": None if rec is None else rec.id,
        "by": gw.coord.link.replica_id if rec is None else rec.by,
        "at": None if rec is None else rec.at,
        "replicas": gw.coord.replicas.ids(),
        "applied_within_s": gw.cfg.coordination.sync_interval_s
        + gw.cfg.coordination.op_timeout_s,
    }
    # the op records preempted them (here at once, elsewhere within a sync round)
    return _answer(gw, replace(out, preempted=tuple(preempted)), fleet)


def install_routes(app: FastAPI) -> None:
    """Register ``GET /admin/zones`` and ``POST /admin/zones/{zone}/notice`` on ``app``."""
    app.add_api_route("/admin/zones", list_zones, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/admin/zones/{zone}/notice", zone_notice, methods=["POST"], include_in_schema=False
    )
