"""The status page: ``GET /status`` (HTML) and ``GET /status.json`` (the same facts).

Per model: availability (backends that can serve it now: warm with the circuit breaker
not open; the share of requests answered without an error of the service over the "now"
window and the last hour), performance against the SLO (P99 TTFT and ITL now and over the
last hour, with their sample counts: a figure on too few samples is shown and said not
judged), and the verdict words of :mod:`gateway.traffic.status_verdict` now and over the
last hour; for the gateway: the worst model's words,
admission's degraded-mode level, backends by state and thermal tier, cooldowns running and
the next one scheduled, and the recent incidents (:mod:`gateway.flow.status`). Read from
memory; no backend is asked.

Backends are named by id only (no URL, no key), and only to clients that may see details
(issue 20, :func:`gateway.api.access.sees_details`: a direct loopback client, the admin
key's holder, or everyone with ``status.public_details``). Others get the same page
without them: no backend list, no backend ids in the cooldowns, incidents by kind and time
only (a discovered backend's id embeds its address; an incident's reason can quote an
error's URL). Everything said about a backend is built in :func:`backend_details` and
:func:`_cooldowns`, and hidden in :func:`public_view`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from gateway.api.access import sees_details
from gateway.api.status_page import render_html
from gateway.core.vocab import SERVING_STATES, BackendState
from gateway.fleet.backend import Backend
from gateway.flow.status import HOUR_S
from gateway.traffic.status_verdict import (
    MAJOR_BELOW,
    PARTIAL_BELOW,
    ModelInputs,
    Window,
    model_verdict,
    overall,
)

if TYPE_CHECKING:
    from gateway.wiring import Gateway


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway  # starlette's State holds untyped attributes
    return gw


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _tier(gw: Gateway, b: Backend, now: float) -> str:
    """``b``'s thermal tier (``unknown`` without GPU telemetry)."""
    if b.thermal is None:
        return "unknown"
    return gw.controller.gpu.view.status(b.id, now).tier.value


def backend_details(gw: Gateway, backends: list[Backend], now: float) -> list[dict[str, Any]]:
    """What the status page says of each backend: id, serving state (the lifecycle state,
    or ``breaker_open``: :func:`gateway.core.vocab.serving_state`), thermal tier, models,
    the maintenance running there. The one place backend details are rendered (module
    docstring): never a URL or a key."""
    return [
        {"id": b.id, "state": b.serving_state, "tier": _tier(gw, b, now),
         "models": list(b.models), "maintenance": b.maintenance}
        for b in backends
    ]


def _cooldowns(gw: Gateway, now: float) -> dict[str, Any]:
    """Backends resting now (``cooldown``) and the next medium cycle (the one that drains
    and rests a backend: ``lifecycle.medium``) due by time, in seconds from now, among the
    backends a cycle can start on: warm ones (``fleet/maintenance.py`` starts cycles only
    there; a dead, draining or resting backend has none scheduled)."""
    backends = gw.fleet.backends
    running = [b.id for b in backends if b.state is BackendState.COOLDOWN]
    due = [(b.cycles.next_medium, b.id) for b in backends
           if b.state is BackendState.WARM and math.isfinite(b.cycles.next_medium)]
    nxt = None
    if due:
        at, bid = min(due)
        nxt = {"backend": bid, "cycle": "medium", "in_s": round(max(0.0, at - now), 1)}
    return {"running": running, "running_count": len(running), "next": nxt}


def status_view(gw: Gateway) -> dict[str, Any]:
    """``/status.json``: ``status`` (the words), ``generated_at`` (Unix seconds), ``slo``,
    ``details`` (True: backend details included; :func:`public_view` makes them False),
    ``windows_s`` (``now``, ``hour``), ``min_samples`` (requests, streams or inter-token
    gaps a window needs to be judged), ``availability_thresholds`` (answered shares under
    which a window is a partial / major outage), ``degraded_mode_level`` (None: degraded
    mode off), ``models`` (each: ``model``, ``status``, ``reasons``, ``notes`` (what too
    few samples left unjudged: count and minimum), ``last_hour`` (its ``status``,
    ``reasons``, ``notes``), ``availability``, ``performance``), ``backends``
    (:func:`backend_details`), ``backend_states`` (counts by serving state) and
    ``backend_tiers`` (counts), ``cooldowns``, ``incidents`` (newest first). Seconds
    throughout; shares 0-1 (None: no requests in the window); a P99 is None only without
    a sample."""
    cfg = gw.cfg
    rec = gw.status
    assert rec is not None
    now, wall = gw.controller.clock(), gw.controller.wall()
    now_s, min_samples = cfg.status.now_s, cfg.status.min_samples
    level = gw.gate.degraded.level if gw.gate.degraded is not None else None
    backends = gw.fleet.backends
    models = sorted(rec.served_models() | set(rec.rollup.models()))
    entries: list[dict[str, Any]] = []
    for model in models:
        serving = Counter(b.serving_state for b in backends if b.serves(model))
        states = tuple((s, serving[s]) for s in SERVING_STATES if serving[s])
        # every figure with its count (min 1): the verdict judges only on min_samples
        ttft_now, streams_now = gw.accounting.model_p99_ttft(model, now_s, 1)
        recent = rec.recent.summary(model, now, now_s, 1)
        hour = rec.rollup.summary(model, now, HOUR_S, 1)
        inputs = ModelInputs(
            model, states,
            Window(now_s, recent.requests, recent.failed, ttft_now, streams_now,
                   recent.itl_p99_s, recent.itl_samples),
            Window(HOUR_S, hour.requests, hour.failed, hour.ttft_p99_s, hour.ttft_samples,
                   hour.itl_p99_s, hour.itl_samples),
            level or 0)
        verdict = model_verdict(inputs, cfg.slo.ttft_s, cfg.slo.itl_s, min_samples)
        last_hour = verdict.hour
        assert last_hour is not None
        entries.append({
            "model": model,
            "status": verdict.words,
            "reasons": list(verdict.reasons),
            "notes": list(verdict.notes),
            "last_hour": {"status": last_hour.words, "reasons": list(last_hour.reasons),
                          "notes": list(last_hour.notes)},
            "availability": {
                "routable_backends": inputs.routable_backends,
                "backends": sum(serving.values()),
                "answered_share_now": _r(recent.answered_share),
                "answered_share_hour": _r(hour.answered_share),
                "requests_now": recent.requests,
                "requests_hour": hour.requests,
                "failed_now": recent.failed,
                "failed_hour": hour.failed,
            },
            "performance": {
                "ttft_p99_now_s": _r(ttft_now),
                "ttft_p99_hour_s": _r(hour.ttft_p99_s),
                "itl_p99_now_s": _r(recent.itl_p99_s),
                "itl_p99_hour_s": _r(hour.itl_p99_s),
                "streams_now": streams_now,
                "streams_hour": hour.ttft_samples,
                "itl_samples_now": recent.itl_samples,
                "itl_samples_hour": hour.itl_samples,
            },
        })
    return {
        "status": overall(e["status"] for e in entries),
        "details": True,
        "generated_at": round(wall, 3),
        "slo": {"ttft_s": cfg.slo.ttft_s, "itl_s": cfg.slo.itl_s},
        "windows_s": {"now": now_s, "hour": HOUR_S},
        "min_samples": min_samples,
        "availability_thresholds": {"partial_outage_below": PARTIAL_BELOW,
                                    "major_outage_below": MAJOR_BELOW},
        "degraded_mode_level": level,
        "models": entries,
        "backends": backend_details(gw, backends, now),
        "backend_states": dict(Counter(b.serving_state for b in backends)),
        "backend_tiers": dict(Counter(_tier(gw, b, now) for b in backends)),
        "cooldowns": _cooldowns(gw, now),
        "incidents": [i.to_json() for i in rec.incidents.recent(50)],
    }


BACKEND_INCIDENTS = frozenset({"breaker_trip", "drain", "unhealthy"})
"""Incident kinds whose subject is a backend id."""


def public_view(view: dict[str, Any]) -> dict[str, Any]:
    """``view`` (:func:`status_view`) without backend details, for a client that may not
    see them (module docstring): ``backends`` empty, ``cooldowns.running`` empty and
    ``next.backend`` None (``running_count`` stays), backend incidents without subject,
    every incident without detail; ``details``: False. A new dict."""
    cd = view["cooldowns"]
    nxt = cd["next"]
    return {
        **view,
        "details": False,
        "backends": [],
        "cooldowns": {**cd, "running": [],
                      "next": None if nxt is None else {**nxt, "backend": None}},
        "incidents": [
            {**i, "subject": None if i["kind"] in BACKEND_INCIDENTS else i["subject"],
             "detail": None}
            for i in view["incidents"]
        ],
    }


def _view_for(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    view = status_view(gw)
    if sees_details(gw.admin_key, gw.cfg.status.public_details, request.scope):
        return view
    return public_view(view)


NO_SHARED_CACHE = {"cache-control": "private, no-store", "vary": "Authorization"}
"""The status answers' cache headers: they differ by caller (details or not, by the admin
key and the peer), so no shared cache may keep one (``private``, ``no-store``: RFC 9111
sections 5.2.2.7 and 5.2.2.5) and ``Vary: Authorization`` says what they depend on
(RFC 9110 section 12.5.5)."""


async def status_json(request: Request) -> Response:
    """``GET /status.json``: :func:`status_view` (:func:`public_view` for a client that
    may not see backend details), never cached (:data:`NO_SHARED_CACHE`)."""
    return JSONResponse(_view_for(request), headers=NO_SHARED_CACHE)


async def status_html(request: Request) -> Response:
    """``GET /status``: the same view as ``/status.json``, as a page readable on a
    phone, never cached (:data:`NO_SHARED_CACHE`)."""
    return HTMLResponse(render_html(_view_for(request)), headers=NO_SHARED_CACHE)


def install_routes(app: FastAPI) -> None:
    """Register ``/status`` and ``/status.json`` on ``app``."""
    app.add_api_route("/status", status_html, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/status.json", status_json, methods=["GET", "HEAD"],
                      include_in_schema=False)
