"""Which backends may take a request now, and when one may again (read-only over the fleet).

Used by the attempts (:mod:`gateway.flow.pipeline`) and the batcher's dispatch
(:mod:`gateway.flow.batching`) alike, so both see the same routable set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.config import HealthConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend


def candidates(
    backends: Iterable[Backend], model: str, tried: Sequence[str], now: float,
    version: str | None = None, fallback: str | None = None,
) -> list[Backend]:
    """Backends that may take a request for ``model`` at monotonic ``now`` and whose ids
    are not in ``tried``: warm, serving it, not cooling after a 429, breaker not open (or a
    free half-open slot). Standby backends only when no primary qualifies; backends
    suspected of hanging (silent on their probes and scrapes,
    :mod:`gateway.fleet.liveness`) only when nothing else does.

    ``version``: the ``model_version`` a canary rollout assigned the request
    (:mod:`gateway.flow.rollouts`; None: versions ignored, as without a rollout): only
    backends of that version, unless none of them qualifies; then those of ``fallback``
    (the rollout's other version), and only when neither has one, any other (the request
    is served by another version rather than refused, and counted as a fallback when it
    ends: availability first; a third version of the model is the last resort, never a
    stand-in for the canary)."""
    if version is not None:
        backends = list(backends)
        for v in (version, fallback):
            if v is None:
                continue
            same = _candidates(
                (b for b in backends if b.config.model_version == v), model, tried, now)
            if same:
                return same
    return _candidates(backends, model, tried, now)


def _candidates(
    backends: Iterable[Backend], model: str, tried: Sequence[str], now: float
) -> list[Backend]:
    primaries: list[Backend] = []
    standbys: list[Backend] = []
    suspects: list[Backend] | None = None
    for b in backends:
        if (
            b.state is not BackendState.WARM
            or model not in b.models
            or b.id in tried
            or b.cooling_until > now
            or not b.breaker.can_take()
        ):
            continue
        if b.suspected:
            suspects = [b] if suspects is None else [*suspects, b]
            continue
        (standbys if b.is_standby else primaries).append(b)
    if primaries or standbys or suspects is None:
        return primaries or standbys
    return [b for b in suspects if not b.is_standby] or suspects


def availability_s(backends: Iterable[Backend], model: str, now: float) -> float | None:
    """Seconds until some backend of ``model`` can take a request again (a 429 cooldown or
    an open breaker ending), or None when none is expected back soon (unhealthy,
    draining, gone)."""
    soonest: float | None = None
    for b in backends:
        if b.state is not BackendState.WARM or model not in b.models:
            continue
        wait = wait_s(b, now)
        soonest = wait if soonest is None else min(soonest, wait)
    return soonest


def wait_s(backend: Backend, now: float) -> float:
    """Seconds (from monotonic ``now``) until ``backend`` takes requests again: the end of
    its 429 cooldown or of its breaker's open time, 0 when neither holds it back."""
    return max(0.0, backend.cooling_until - now, backend.breaker.retry_in())


def recovery_s(health: HealthConfig) -> float:
    """Seconds until an unroutable backend could plausibly be routable again: one
    recovery of probes (``interval_s`` x ``recover_threshold``), at least 1 s."""
    return max(1.0, health.interval_s * health.recover_threshold)
