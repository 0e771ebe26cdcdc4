"""``GET /autoscale``: the autoscaling signals as JSON, for KEDA's ``metrics-api`` scaler and
scripts (:mod:`gateway.flow.autoscaling` decides; this module only reads its answers).

* ``GET /autoscale``: ``{"decided_by", "inputs", "interval_s", "models": {model: answer}}``;
* ``GET /autoscale?model=X``: that model's answer alone, flat: ``desired_replicas`` at the
  top level, so KEDA's ``valueLocation: desired_replicas`` works for any model name (dots
  and slashes included, which a GJSON path into ``models`` would have to escape).

An answer: :meth:`gateway.autoscale.Decision.as_dict` (``at`` in unix seconds) plus
``min_replicas``, ``max_replicas``, ``cold_start_s``, ``cold_start_measured``,
``decided_by``, ``inputs`` (``fleet`` or ``local``) and ``arrivals`` (the arrival rate,
the ahead window's forecast and its upper end in requests/s, the TTFT P99 in seconds and
its samples, as this replica decided on them).

Errors (OpenAI shape): 400 ``invalid_value`` for an empty ``?model=`` or more than one
(KEDA's ``url`` with a typo would otherwise read one model's answer as another's, or a
404 that looks like a model no backend serves); 404 ``model_not_found`` for a model the
autoscaler does not decide for; 404 ``autoscale_disabled`` with ``autoscale.enabled:
false`` (the resource does not exist on this gateway: nothing will ever be there, a
retry cannot help); 503 ``autoscale_not_ready`` (with ``retry-after``) for a known model
before the first decision. Guarded like ``/ready/fleet`` and ``/metrics`` (the read-only
operator endpoints): no key, read from memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.core.outcomes import SERVER_ERROR, Refusal

if TYPE_CHECKING:
    from gateway.flow.autoscaling import AutoscaleSignals
    from gateway.wiring import Gateway


def _signals(request: Request) -> AutoscaleSignals:
    gw: Gateway = request.app.state.gateway
    if gw.autoscaling is None:
        raise Refusal(
            404,
            "Autoscaling signals are off on this gateway (autoscale.enabled: false).",
            code="autoscale_disabled",
        )
    return gw.autoscaling


async def get_autoscale(request: Request) -> Response:
    """Every model's answer, or one model's flat (``?model=``); see the module docstring."""
    signals = _signals(request)
    given = request.query_params.getlist("model")
    if not given:
        return JSONResponse(signals.summary())
    if len(given) > 1 or not given[0].strip():
        raise Refusal(
            400,
            "Give one model id in ?model= (URL-encoded; without it: every model's answer).",
            param="model",
            code="invalid_value",
            retryable=False,
        )
    model = given[0]
    answer = signals.answers.get(model)
    if answer is not None:
        return JSONResponse({"model": model, **answer.as_dict()})
    if model in signals.models():
        raise Refusal(
            503,
            f"No autoscaling decision for model '{model}' yet.",
            SERVER_ERROR,
            code="autoscale_not_ready",
            retry_after_s=signals.cfg.interval_s,
        )
    raise Refusal(
        404,
        f"The model '{model}' does not exist (no backend serves it).",
        param="model",
        code="model_not_found",
    )


def install_routes(app: FastAPI) -> None:
    """Register ``GET /autoscale`` on ``app``."""
    app.add_api_route(
        "/autoscale", get_autoscale, methods=["GET", "HEAD"], include_in_schema=False
    )
