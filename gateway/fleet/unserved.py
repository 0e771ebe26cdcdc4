"""The report of an engine check that found no endpoint served (no health verdict)."""

from __future__ import annotations

import logging

from gateway.fleet.backend import Backend
from gateway.fleet.probes import ENGINE_ENDPOINTS, ProbeEndpoints
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


def report_unserved(
    metrics: GatewayMetrics,
    endpoints: ProbeEndpoints,
    backend: Backend,
    model: str,
    check: str,
    detail: str,
) -> None:
    """``check`` (warmup / app_probe / calibration) found ``backend`` answering but
    serving none of the engine endpoints for ``model``: not a health verdict, the check
    passes. Counted in ``gateway_probe_unserved_total``; noted in the backend's last
    error and logged once (until an endpoint answers again)."""
    metrics.probe_unserved.labels(backend.id, check).inc()
    if endpoints.report(backend.id, model) is None:
        return
    message = (
        f"{check}: serves none of {', '.join(ENGINE_ENDPOINTS)} for model {model} "
        f"({detail}); warm-up and probes pass without a verdict, calibration is skipped"
    )
    backend.note_error(message)
    log.warning("backend %s: %s", backend.id, message)
