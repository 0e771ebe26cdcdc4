"""Backend lifecycle state machine (pure: no I/O; time is passed in).

States and the legal moves between them (DESIGN.md, "Backend states")::

    cold -> warming -> warm -> draining -> cooldown -> warming/warm
    draining -> warm (undrain) | cold (restart hook)      any -> unhealthy
    unhealthy -> warming | cold

Every change goes through :func:`apply_transition`, which rejects illegal moves with
:class:`IllegalTransition` and appends to the backend's history. Health decisions
(:func:`after_probe`, :func:`after_traffic`) are pure functions of the counters and the
thresholds in :class:`gateway.config.HealthConfig`: fail after ``fail_threshold`` failed
probes in a row, recover after ``recover_threshold`` passing ones (Envoy's active health
checking uses the same unhealthy/healthy threshold pair).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import HealthConfig
from gateway.fleet.backend import Backend, BackendState, Transition

S = BackendState

LEGAL: dict[BackendState, frozenset[BackendState]] = {
    S.COLD: frozenset({S.WARMING, S.UNHEALTHY}),
    S.WARMING: frozenset({S.WARM, S.UNHEALTHY, S.COLD}),
    S.WARM: frozenset({S.DRAINING, S.UNHEALTHY}),
    S.DRAINING: frozenset({S.COOLDOWN, S.WARM, S.COLD, S.UNHEALTHY}),
    S.COOLDOWN: frozenset({S.WARMING, S.WARM, S.UNHEALTHY, S.COLD}),
    S.UNHEALTHY: frozenset({S.WARMING, S.COLD}),
}


class IllegalTransition(ValueError):
    """A state change the lifecycle does not allow (e.g. ``cold -> draining``)."""


def check_transition(frm: BackendState, to: BackendState) -> None:
    """Raise :class:`IllegalTransition` unless ``frm -> to`` is allowed."""
    if to not in LEGAL[frm]:
        raise IllegalTransition(f"illegal backend transition {frm} -> {to}")


def apply_transition(backend: Backend, to: BackendState, reason: str, now: float) -> Transition:
    """Move ``backend`` to ``to``; ``now`` is wall-clock unix seconds (for the history).

    Returns the :class:`Transition` (the caller logs it and counts it in metrics).
    Raises :class:`IllegalTransition` for a move outside :data:`LEGAL`.
    """
    check_transition(backend.state, to)
    t = Transition(at=now, from_state=backend.state, to_state=to, reason=reason)
    backend.state = to
    backend.history.append(t)
    return t


@dataclass(frozen=True, slots=True)
class Decision:
    """A state change a health rule asks for: ``to`` and a short machine-readable reason."""

    to: BackendState
    reason: str


def after_probe(backend: Backend, ok: bool, cfg: HealthConfig) -> Decision | None:
    """Update probe counters of ``backend`` with one probe result; return a wanted change.

    * a failing probe: after ``cfg.fail_threshold`` in a row, a backend that was serving
      (warming/warm/draining/cooldown) becomes ``unhealthy`` (reason ``probe_failed``);
      a ``cold`` one stays cold.
    * a passing probe: ``cold`` -> ``warming`` at once (it answers now); ``unhealthy`` ->
      ``warming`` after ``cfg.recover_threshold`` passes in a row.
    """
    if ok:
        backend.consecutive_probe_failures = 0
        backend.consecutive_probe_successes += 1
        if backend.state is S.COLD:
            return Decision(S.WARMING, "probe_ok")
        if (
            backend.state is S.UNHEALTHY
            and backend.consecutive_probe_successes >= cfg.recover_threshold
        ):
            return Decision(S.WARMING, "probe_recovered")
        return None
    backend.consecutive_probe_successes = 0
    backend.consecutive_probe_failures += 1
    if (
        backend.state in (S.WARMING, S.WARM, S.DRAINING, S.COOLDOWN)
        and backend.consecutive_probe_failures >= cfg.fail_threshold
    ):
        return Decision(S.UNHEALTHY, "probe_failed")
    return None


def after_traffic(backend: Backend, failed: bool, cfg: HealthConfig) -> Decision | None:
    """Passive outlier detection from real traffic.

    ``failed`` is a connect error, timeout, broken stream or 5xx (never a 4xx, a 429 or a
    client disconnect). After ``cfg.passive_fail_threshold`` in a row a serving backend
    becomes ``unhealthy`` (reason ``passive_outlier``); any success resets the count.
    """
    if not failed:
        backend.consecutive_traffic_failures = 0
        return None
    backend.consecutive_traffic_failures += 1
    if (
        backend.state in (S.WARMING, S.WARM, S.DRAINING, S.COOLDOWN)
        and backend.consecutive_traffic_failures >= cfg.passive_fail_threshold
    ):
        backend.consecutive_probe_successes = 0
        return Decision(S.UNHEALTHY, "passive_outlier")
    return None
