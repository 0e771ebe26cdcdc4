"""Admin surface (``/admin/...``): what the gateway knows about each backend.

Guarded like every path under ``/admin`` (:mod:`gateway.api.access`): the admin key when one
is configured (``Authorization: Bearer <key>``), else loopback clients only.

In fleet mode (``coordination.redis_url``) the writes (drain, undrain, preempt) are written to
the shared store and applied by every replica (:mod:`gateway.coord.operator`; the answer's
``fleet`` object says so), and a cooldown runs through the fleet-wide maintenance cycle.
While the store does not answer every write is refused (503 ``coordination_unavailable``,
with ``retry-after``) and changes nothing on any replica, this one included: a drain applied
on one replica only is what fleet mode exists to prevent. Reads keep working.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.api.errors import SERVER_ERROR, Refusal
from gateway.coord.link import CoordinationUnavailable
from gateway.coord.operator import OperatorActions, OpRecord
from gateway.core.urls import redacted_url
from gateway.fleet.backend import Backend
from gateway.fleet.drain import Drains

if TYPE_CHECKING:
    from gateway.wiring import Gateway


def _gateway(request: Request) -> Gateway:
    """The app's gateway. Who may call an admin route was decided before the route ran
    (:func:`gateway.api.access.admin_refusal`, applied by :class:`gateway.app.GatewayApp`
    to every path under ``/admin``)."""
    gw: Gateway = request.app.state.gateway
    return gw


def backend_summary(gw: Gateway, b: Backend) -> dict[str, Any]:
    """One backend as JSON: state, load (last scrape), in-flight, errors. Ages in seconds."""
    now = gw.controller.clock()
    load = None
    if b.load is not None:
        load = {
            "waiting": b.load.waiting,
            "running": b.load.running,
            "kv_cache_usage": b.load.kv_cache_usage,
            "age_s": round(now - b.load.scraped_at, 3),
        }
    return {
        "id": b.id,
        "url": redacted_url(b.base_url),
        "role": b.config.role.value,
        "state": b.state.value,
        "models": list(b.models),
        "model_version": b.config.model_version,
        "in_flight": b.in_flight,
        "requests_served": b.requests_served,
        "load": load,
        "last_scrape_age_s": (
            None if b.last_scrape_ok_at is None else round(now - b.last_scrape_ok_at, 3)
        ),
        "last_error": b.last_error,
        "last_error_at": b.last_error_at,
        "config_error": b.config_error,
        "drained": b.drained,
        "hold": b.hold,
        "maintenance": b.maintenance,
        "deferred": None
        if b.deferred is None
        else {"cycle": b.deferred.cycle, "for_s": round(now - b.deferred.since, 1),
              "reason": b.deferred.reason},
        "capacity": {
            "concurrency": _r(b.service.concurrency),
            "service_rate_rps": _r(b.service.service_rate, 2),
            "completion_rate_rps": _r(b.service.completion_rate, 2),
            "service_time_s": _r(b.service.service_s, 3),
            "ceiling": _r(b.service.ceiling),
            "capacity_rps": _r(b.service.capacity_rps, 2),
        },
        "drain_deadline_in_s": (
            None if b.drain_deadline is None else round(b.drain_deadline - now, 3)
        ),
        "slow_start_weight": round(gw.router.weight(b, now), 3) if b.state.value == "warm" else 0.0,
        "calibration_score": b.calibration_score,
        "probe_ttft_s": b.probe_ttft_s,
        "consecutive_probe_failures": b.consecutive_probe_failures,
        # the hung watchdog (gateway.fleet.liveness): alive / suspect / hung, and the silence
        # so far (seconds owing a probe or scrape answer with nothing heard)
        "liveness": {
            "verdict": b.liveness.verdict.value,
            "suspected": b.suspected,
            "silence_s": round(b.liveness.silence_s, 3),
            "owed": b.liveness.owed,
        },
        "breaker": {
            "state": b.breaker.current().value,
            "consecutive_failures": b.breaker.consecutive,
            "trips": b.breaker.trips,
            "last_trip_reason": b.breaker.last_trip_reason,
            "retry_in_s": round(b.breaker.retry_in(), 3),
        },
        "cooling_for_s": round(max(0.0, b.cooling_until - now), 3),
        "gpu": gpu_summary(gw, b, now),
    }


def _r(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


def gpu_summary(gw: Gateway, b: Backend, now: float) -> dict[str, Any]:
    """GPU telemetry of one backend as the router sees it (°C, W, MHz, seconds).

    ``monitored`` False: no ``gpu_metrics_url`` configured (tier unknown by design).
    ``tier`` ``unknown`` with ``monitored`` True: telemetry missing or stale (``error``)."""
    if b.thermal is None or b.gpu_health is None:
        return {"monitored": False, "tier": "unknown", "power_domain": b.config.power_domain}
    st = gw.controller.gpu.view.status(b.id, now)
    last = b.thermal.latest
    clocks = gw.controller.gpu.clocks
    return {
        "monitored": True,
        "tier": st.tier.value,
        "temperature_c": _r(st.temp_c),
        "predicted_temperature_c": _r(st.predicted_c),
        "slope_c_per_s": _r(st.slope_c_per_s, 4),
        "power_w": _r(st.power_w),
        "power_limit_ratio": _r(st.power_ratio, 3),
        "power_limit_w": _r(last.power_limit_w) if last is not None else None,
        "sm_clock_mhz": _r(last.sm_clock_mhz, 0) if last is not None else None,
        "gpus": last.gpus if last is not None else 0,
        "sample_age_s": None if last is None else round(now - last.at, 3),
        "hot_latched": b.thermal.hot_latched,
        "power_domain": b.config.power_domain,
        "recent_xid_errors": b.gpu_health.recent_xids(now),
        "error": b.gpu_error,
        "clock_cap": None if clocks is None else clocks.summary(b.id),
        "power_cap": None if clocks is None else clocks.power_summary(b.id),
    }


def power_domains_summary(gw: Gateway, now: float) -> list[dict[str, Any]]:
    """Each power domain: summed draw of its reporting backends against budget (W)."""
    view = gw.controller.gpu.view
    return [
        {
            "name": d.name,
            "budget_w": d.budget_w,
            "target_w": d.target_w,
            "draw_w": round(d.draw_w, 1),
            "utilisation": round(d.utilisation, 3),
            "over_target": d.over_target,
            "members": d.members,
            "reporting": d.reporting,
            "age_s": round(now - view.at, 3),
        }
        for d in view.domains.values()
    ]


async def list_backends(request: Request) -> Response:
    """Every backend, in config order."""
    gw = _gateway(request)
    return JSONResponse(
        {
            "backends": [backend_summary(gw, b) for b in gw.fleet.backends],
            "power_domains": power_domains_summary(gw, gw.controller.clock()),
        }
    )


async def get_backend(backend_id: str, request: Request) -> Response:
    """One backend with its recent state history (last 20 transitions)."""
    gw = _gateway(request)
    b = gw.fleet.get(backend_id)
    if b is None:
        raise Refusal(404, f"No backend with id '{backend_id}'.", code="backend_not_found")
    out = backend_summary(gw, b)
    out["history"] = [
        {"at": t.at, "from": t.from_state.value, "to": t.to_state.value, "reason": t.reason}
        for t in b.history
    ]
    return JSONResponse(out)


def _backend(gw: Gateway, backend_id: str) -> Backend:
    b = gw.fleet.get(backend_id)
    if b is None:
        raise Refusal(404, f"No backend with id '{backend_id}'.", code="backend_not_found")
    return b


MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer deadlines or rests are mistakes
_DEADLINE = frozenset({"deadline_s"})


async def _options(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The JSON object body (empty: ``{}``); 400 for anything else or for a field not in
    ``allowed`` (a typo such as ``deadlin_s`` must not silently mean the default)."""
    body = await request.body()
    if not body:
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        raise Refusal(400, "Body must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise Refusal(400, "Body must be a JSON object.", code="invalid_json")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise Refusal(
            400,
            f"Unknown field '{unknown[0]}'; this action accepts: "
            f"{', '.join(sorted(allowed)) or 'no fields'}.",
            param=unknown[0],
            code="unknown_field",
        )
    return data


def _number(opts: dict[str, Any], key: str, default: float) -> float:
    """A number of seconds in [0, a week]; 400 naming ``key`` otherwise (NaN, inf, huge)."""
    value = opts.get(key, default)
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        try:
            ok = math.isfinite(float(value)) and 0 <= float(value) <= MAX_SECONDS
        except OverflowError:
            ok = False
    if not ok:
        raise Refusal(
            400,
            f"'{key}' must be a number of seconds between 0 and {MAX_SECONDS:g}.",
            param=key,
            code="invalid_value",
        )
    return float(value)


def _flag(opts: dict[str, Any], key: str) -> bool:
    value = opts.get(key, False)
    if not isinstance(value, bool):
        raise Refusal(400, f"'{key}' must be true or false.", param=key, code="invalid_value")
    return value


def _store_down(gw: Gateway, reason: str) -> Refusal:
    """503 for an admin write while the shared store does not answer."""
    retry = gw.cfg.coordination.retry_interval_s
    return Refusal(
        503,
        f"Not applied: {reason or 'the shared store (Redis) does not answer'}. In fleet mode "
        "an admin action goes through the shared store so that every replica applies it; "
        "nothing changed on any replica. Retry once the store answers (reads such as "
        "GET /admin/backends keep working).",
        SERVER_ERROR,
        "coordination_unavailable",
        retry_after_s=max(1.0, retry),
    )


def _fleet_writes(gw: Gateway) -> OperatorActions | None:
    """Fleet mode: the replica's operator part, once the store is known to answer (503
    otherwise). None in the embedded default (the action is this process's own)."""
    coord = gw.coord
    if coord is None or coord.operator is None:
        return None
    if coord.link.fallback:
        raise _store_down(gw, coord.link.reason)
    return coord.operator


async def _submit(
    gw: Gateway,
    ops: OperatorActions,
    b: Backend,
    action: str,
    deadline_s: float | None = None,
    hold_s: float | None = None,
) -> Response:
    """Write ``action`` for the fleet and apply it here; the backend as JSON with ``fleet``:
    the op record (store times: unix seconds of the store's clock) and the replicas that
    apply it. 503 when the store fails meanwhile (nothing written)."""
    try:
        rec = await ops.submit(b, action, deadline_s, hold_s)
    except CoordinationUnavailable as e:
        raise _store_down(gw, str(e)) from None
    out = backend_summary(gw, b)
    out["fleet"] = _accepted(gw, rec)
    return JSONResponse(out, status_code=200 if action == "undrain" else 202)


def _accepted(gw: Gateway, rec: OpRecord) -> dict[str, Any]:
    assert gw.coord is not None
    return {
        "accepted": "fleet-wide",
        "op_id": rec.id,
        "action": rec.action,
        "by": rec.by,
        "at": rec.at,
        "deadline_at": rec.deadline_at,
        "until_at": rec.until_at,
        "replicas": gw.coord.replicas.ids(),
        "applied_within_s": gw.cfg.coordination.sync_interval_s
        + gw.cfg.coordination.op_timeout_s,
    }


async def drain_backend(backend_id: str, request: Request) -> Response:
    """Stop new requests to the backend now; in-flight ones finish or, at ``deadline_s``
    (default ``lifecycle.drain_deadline_s``), streams end with an error event. 202."""
    gw = _gateway(request)
    b = _backend(gw, backend_id)
    deadline = _number(
        await _options(request, _DEADLINE), "deadline_s", gw.cfg.lifecycle.drain_deadline_s
    )
    ops = _fleet_writes(gw)
    if ops is not None and Drains.would_start_drain(b):
        return await _submit(gw, ops, b, "drain", deadline_s=deadline)
    if ops is not None or not gw.controller.start_drain(b, deadline):
        raise Refusal(
            409,
            f"Backend '{backend_id}' is already draining or drained ({b.state.value}).",
            code="invalid_state",
        )
    return JSONResponse(backend_summary(gw, b), status_code=202)


async def preempt_backend(backend_id: str, request: Request) -> Response:
    """Spot-preemption notice: a drain with ``lifecycle.preempt_deadline_s`` (30 s), then
    ``cold`` (the instance is going away; probes bring it back if it returns). 202."""
    gw = _gateway(request)
    b = _backend(gw, backend_id)
    deadline = _number(
        await _options(request, _DEADLINE), "deadline_s", gw.cfg.lifecycle.preempt_deadline_s
    )
    ops = _fleet_writes(gw)
    if ops is not None and Drains.would_start_drain(b, preempt=True):
        return await _submit(
            gw, ops, b, "preempt", deadline_s=deadline, hold_s=gw.cfg.lifecycle.preempt_hold_s
        )
    if ops is not None or not gw.controller.start_drain(b, deadline, preempt=True):
        raise Refusal(
            409, f"Backend '{backend_id}' is already preempted.", code="invalid_state"
        )
    return JSONResponse(backend_summary(gw, b), status_code=202)


async def undrain_backend(backend_id: str, request: Request) -> Response:
    """Return a draining or resting backend to rotation (through slow start). Refused
    (409 ``backend_leaving``) while discovery is taking it out of the fleet (its endpoint
    terminating or gone): the operator cannot bring back what Kubernetes or DNS removes."""
    gw = _gateway(request)
    b = _backend(gw, backend_id)
    leaving = gw.controller.membership.leaving(b.id)
    if leaving is not None:
        raise Refusal(
            409,
            f"Backend '{backend_id}' is leaving the fleet ({leaving}: discovery "
            f"({gw.controller.membership.source_name}) no longer lists its endpoint as "
            "serving); it returns by itself if its endpoint serves again.",
            code="backend_leaving",
        )
    ops = _fleet_writes(gw)
    if ops is not None and (Drains.would_undrain(b) or ops.holds(b)):
        return await _submit(gw, ops, b, "undrain")
    if ops is not None or not gw.controller.undrain(b):
        raise Refusal(
            409,
            f"Backend '{backend_id}' is {b.state.value}, not draining or in cooldown.",
            code="invalid_state",
        )
    return JSONResponse(backend_summary(gw, b))


async def cooldown_backend(backend_id: str, request: Request) -> Response:
    """Run the medium cycle now (drain -> reset prefix cache -> rest -> calibration ->
    slow-start return). Refused (409) when staggering forbids it, unless ``"force": true``.
    ``min_rest_s`` lengthens the rest."""
    gw = _gateway(request)
    b = _backend(gw, backend_id)
    opts = await _options(request, frozenset({"min_rest_s", "force"}))
    rest = _number(opts, "min_rest_s", 0.0)
    force = _flag(opts, "force")
    if _fleet_writes(gw) is not None:  # 503 while the store does not answer
        if not gw.controller.request_cooldown(b.id, "admin", rest, force=force):
            raise Refusal(409, _cooldown_refused(gw, b, force), code="invalid_state")
        # in fleet mode the cycle starts once its lease is granted (one store call): say
        # whether it did, rather than accept a cooldown the fleet then refuses in silence
        if not await _cooldown_started(gw, b):
            raise Refusal(409, _cooldown_refused(gw, b, force), code="invalid_state")
        return JSONResponse(backend_summary(gw, b), status_code=202)
    if not gw.controller.request_cooldown(b.id, "admin", rest, force=force):
        raise Refusal(
            409,
            f"Backend '{backend_id}' cannot start a cooldown now: it is "
            f"{b.state.value}{' and busy' if gw.controller.busy(b) else ''}, or "
            "taking it out would leave its model without enough warm backends, or a "
            "running rollout of it without a routable backend of one of its versions "
            '(send {"force": true} to override).',
            code="invalid_state",
        )
    return JSONResponse(backend_summary(gw, b), status_code=202)


async def _cooldown_started(gw: Gateway, b: Backend) -> bool:
    """Fleet mode: wait until ``b``'s cooldown has taken its lease and left rotation (True)
    or its procedure ended without (False: the lease was refused). Bounded by two store
    round trips plus a second (``coordination.op_timeout_s``); still undecided then: True
    (the procedure runs; ``/admin/fleet`` shows its lease once granted)."""
    limit = gw.cfg.coordination.op_timeout_s * 4 + 1.0
    loop = asyncio.get_running_loop()
    until = loop.time() + limit
    while loop.time() < until:
        if b.state.value != "warm":
            return True
        if not gw.controller.busy(b):
            return b.state.value != "warm"
        await asyncio.sleep(0.02)
    return True


def _cooldown_refused(gw: Gateway, b: Backend, force: bool) -> str:
    """Why a fleet-mode cooldown did not start, as far as this replica can tell."""
    head = f"Backend '{b.id}' cannot start a cooldown now: "
    if b.state.value != "warm":
        return head + f"it is {b.state.value}, not warm."
    if gw.controller.busy(b) or b.maintenance is not None:
        what = f" ({b.maintenance})" if b.maintenance else ""
        return head + f"a maintenance procedure{what} runs on it, here or on another replica."
    why = head + (
        "another replica holds its maintenance lease, or taking it out would exceed "
        "lifecycle.max_unavailable or leave its model without enough warm backends, "
        "counted over the whole fleet, or a running rollout of it without a routable "
        "backend of one of its versions"
    )
    return why + ("." if force else ' (send {"force": true} to override staggering).')


def install_routes(app: FastAPI) -> None:
    """Register the ``/admin/...`` routes on ``app``."""
    app.add_api_route("/admin/backends", list_backends, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/admin/backends/{backend_id}", get_backend, methods=["GET"], include_in_schema=False
    )
    for action, fn in (
        ("drain", drain_backend),
        ("undrain", undrain_backend),
        ("preempt", preempt_backend),
        ("cooldown", cooldown_backend),
    ):
        app.add_api_route(
            f"/admin/backends/{{backend_id}}/{action}",
            fn,
            methods=["POST"],
            include_in_schema=False,
        )


# ---- /admin/fleet: the replicas of this fleet (fleet mode, issue 14) -------------------------
# Kept apart from the backend routes above; the view is built in gateway/api/fleet.py from what
# the coordination loop left in memory (no store call: it answers the same while Redis is down).


async def get_fleet(request: Request) -> Response:
    """``GET /admin/fleet`` (:func:`gateway.api.fleet.fleet_summary`): this replica, the
    store, the live replicas and the maintenance leases; 200 with ``fleet_mode: false``
    without ``coordination.redis_url``. Guarded by the admin key like every route here."""
    from gateway.api.fleet import fleet_summary  # here: this block stays apart from the rest

    return JSONResponse(fleet_summary(_gateway(request)))


def install_fleet_route(app: FastAPI) -> None:
    """Register ``GET /admin/fleet`` on ``app``."""
    app.add_api_route("/admin/fleet", get_fleet, methods=["GET"], include_in_schema=False)
