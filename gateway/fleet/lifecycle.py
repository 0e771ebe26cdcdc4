"""Backend lifecycle state machine (pure: no I/O; time is passed in).

States and the legal moves between them (docs/architecture.md, "Backend states")::

    cold -> warming -> warm -> draining -> cooldown -> warming/warm
    draining -> warm (undrain) | cold (restart hook)      any -> unhealthy
    unhealthy -> warming | cold

Maintenance cycles (seed 000), all periods configurable (:class:`LifecycleConfig`):

* short (5 min): an application probe; no traffic change unless it fails;
* medium (30 min or 10,000 requests served, whichever first): drain -> reset prefix cache
  -> rest -> calibration -> slow-start return;
* long (4 h): drain -> restart hook -> cold -> warming.

When each cycle is due is :mod:`gateway.fleet.cycles`' arithmetic. :func:`may_take_out`
keeps at most ``max_unavailable`` backends of a model out of rotation and never its last
warm one (Kubernetes' ``maxUnavailable`` with the percentage rounded down, at least 1);
while a canary rollout of the model runs, never the last routable backend of either of its
versions either (:func:`rollout_hold`: the rollout's comparison and calibration need both). A
scheduled cycle that takes a backend out also waits until the others can carry the load
(:func:`can_carry_without`): maintenance never costs capacity the load needs; it is
deferred to the next quiet moment instead.

Every change is checked against :data:`LEGAL` (:func:`transition_of` builds it and rejects
an illegal move with :class:`IllegalTransition`; :class:`gateway.fleet.state.FleetState`
applies it, :func:`apply_transition` too for a backend outside a gateway). Health decisions
(:func:`after_probe`) are pure functions of the counters and the
thresholds in :class:`gateway.config.HealthConfig`: fail after ``fail_threshold`` failed
probes in a row, recover after ``recover_threshold`` passing ones (Envoy's active health
checking uses the same unhealthy/healthy threshold pair).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gateway.config import HealthConfig, LifecycleConfig
from gateway.core.samples import LoadSample
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.records import Transition

S = BackendState

LEGAL: dict[BackendState, frozenset[BackendState]] = {
    S.COLD: frozenset({S.WARMING, S.UNHEALTHY}),
    S.WARMING: frozenset({S.WARM, S.DRAINING, S.UNHEALTHY, S.COLD}),
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


def transition_of(backend: Backend, to: BackendState, reason: str, now: float) -> Transition:
    """The :class:`Transition` of ``backend`` to ``to`` (``now``: wall-clock unix seconds,
    for the history), applied by nobody yet. Raises :class:`IllegalTransition` for a move
    outside :data:`LEGAL`."""
    check_transition(backend.state, to)
    return Transition(at=now, from_state=backend.state, to_state=to, reason=reason)


def apply_transition(backend: Backend, to: BackendState, reason: str, now: float) -> Transition:
    """Move ``backend`` to ``to`` at once (its own :meth:`~Backend.apply_control`), with no
    other effect: for a backend outside any gateway (the fleet simulator, tests); the
    gateway's transitions go through :meth:`gateway.fleet.state.FleetState.transition`.

    Returns the :class:`Transition`; raises :class:`IllegalTransition` for a move outside
    :data:`LEGAL`.
    """
    t = transition_of(backend, to, reason, now)
    backend.apply_control(replace(backend.control(), state=to), t)
    return t


@dataclass(frozen=True, slots=True)
class Decision:
    """A state change a health rule asks for: ``to`` and a short machine-readable reason."""

    to: BackendState
    reason: str


def after_probe(backend: Backend, ok: bool, cfg: HealthConfig) -> Decision | None:
    """Count one probe result in ``backend``'s counters (:meth:`~Backend.count_probe`);
    return the change it asks for.

    * a failing probe: after ``cfg.fail_threshold`` in a row, a backend that was serving
      (warming/warm/draining/cooldown) becomes ``unhealthy`` (reason ``probe_failed``);
      a ``cold`` one stays cold.
    * a passing probe: ``cold`` -> ``warming`` at once (it answers now); ``unhealthy`` ->
      ``warming`` after ``cfg.recover_threshold`` passes in a row; never while the backend
      is held out of rotation (``backend.hold``: an admin drain, a spot preemption or a
      restart that has not happened yet).
    """
    backend.count_probe(ok)
    if ok:
        if backend.hold is not None:
            return None  # held out of rotation (admin drain, preemption, restart)
        if backend.state is S.COLD:
            return Decision(S.WARMING, "probe_ok")
        if (
            backend.state is S.UNHEALTHY
            and backend.consecutive_probe_successes >= cfg.recover_threshold
        ):
            return Decision(S.WARMING, "probe_recovered")
        return None
    if (
        backend.state in (S.WARMING, S.WARM, S.DRAINING, S.COOLDOWN)
        and backend.consecutive_probe_failures >= cfg.fail_threshold
    ):
        return Decision(S.UNHEALTHY, "probe_failed")
    return None


# ---- staggering ------------------------------------------------------------------------
def max_unavailable(model_backends: int, cfg: LifecycleConfig) -> int:
    """How many of a model's ``model_backends`` may be out of rotation at once."""
    if cfg.max_unavailable is not None:
        return cfg.max_unavailable
    return max(1, math.floor(0.25 * model_backends))


RolloutVersions = Mapping[str, tuple[str, str]]
"""Each model with a running canary rollout: its ``(baseline, canary)`` ``model_version``s
(:meth:`gateway.flow.rollouts.Rollouts.running_versions`)."""


def rollout_hold(
    backend: Backend, fleet: Sequence[Backend], rollouts: RolloutVersions
) -> str | None:
    """Why ``backend`` must stay in rotation for a running rollout, or None.

    While a rollout of a model ``backend`` serves runs, and ``backend``'s ``model_version``
    is its baseline or its canary, ``backend`` is held when it is the last *routable*
    backend (warm, breaker not open) of that version of the model: taking it out would send
    the version's requests to the other one (fallbacks) and skip its calibration, spoiling
    the comparison the rollout decides on. A backend not routable itself adds nothing and is
    not held."""
    version = backend.config.model_version
    if version is None or not backend.routable:
        return None
    for model in backend.models:
        pair = rollouts.get(model)
        if pair is None or version not in pair:
            continue
        if not any(
            b is not backend and b.routable and model in b.models
            and b.config.model_version == version
            for b in fleet
        ):
            side = "canary" if version == pair[1] else "baseline"
            return f"last routable {side} backend ({version}) of {model} while its rollout runs"
    return None


def may_take_out(
    backend: Backend,
    fleet: Sequence[Backend],
    cfg: LifecycleConfig,
    rollouts: RolloutVersions | None = None,
) -> bool:
    """Whether a maintenance cycle may take ``backend`` out of rotation now.

    For every model it serves: after taking it out, at least one *other* backend of the
    model must be warm, and no more than :func:`max_unavailable` of the model's backends may
    be out of rotation (any state but ``warm`` counts as out: draining, cooldown, warming,
    cold, unhealthy). Only a warm backend is taken out. With ``rollouts`` (the running
    rollouts' versions), never the last routable backend of a version under rollout
    (:func:`rollout_hold`).
    """
    if backend.state is not S.WARM or not backend.models:
        return False
    if rollouts and rollout_hold(backend, fleet, rollouts) is not None:
        return False
    for model in backend.models:
        peers = [b for b in fleet if model in b.models]
        out = sum(1 for b in peers if b.state is not S.WARM)
        warm_others = sum(1 for b in peers if b is not backend and b.state is S.WARM)
        if warm_others == 0 or out + 1 > max_unavailable(len(peers), cfg):
            return False
    return True


# ---- capacity before maintenance -----------------------------------------------------------
QUIET_RPS = 0.05  # below this a model's demand is idle (one request every 20 s)


def can_carry_without(
    backend: Backend,
    fleet: Sequence[Backend],
    demand_rps: Mapping[str, float],
    target_utilization: float,
    now: float | None = None,
    stale_after_s: float = 5.0,
) -> str | None:
    """Whether the other warm backends can carry the load if ``backend`` leaves rotation
    for a maintenance cycle: None when they can, else why not (shown to operators).

    For every model ``backend`` serves, the demand (requests/s: ``demand_rps[model]``, the
    larger of the measured completion rate and the arrival forecast, or the completion
    rate of the model's backends when absent; at least the requests running on them over
    their service time, Little's law, so a load that just rose counts at once) must fit in
    ``target_utilization`` of the others' capacity
    (:attr:`gateway.traffic.capacity.ServiceModel.capacity_rps`: their learned service time
    at their concurrency, or at vLLM's own bound while they were never saturated; an
    unknown one counts as the mean of the model's known ones). ``target_utilization`` 0.8:
    an M/M/c queue at that load keeps waits short next to the service time (Erlang C;
    Kleinrock vol. 1, 3.5), so what queues meanwhile starts well within a TTFT SLO. A model
    whose demand is quiet (under :data:`QUIET_RPS`) with nothing in flight always passes.
    """
    for model in backend.models:
        # only backends serving now count: a dead one's last load is no demand
        peers = [b for b in fleet if model in b.models and b.state in SERVING]
        others = [b for b in peers if b is not backend and b.state is S.WARM]
        demand = demand_rps.get(model)
        if demand is None:
            demand = sum(b.service.completion_rate for b in peers)
        in_system = sum(_in_system(b, now, stale_after_s) for b in peers)
        # what runs now, by Little's law (rate = running / S): a load that just rose shows
        # here before the completion rate and the forecast, both averages, catch up (queued
        # requests are left out: they are not served faster than the running ones finish)
        demand = max(
            demand,
            sum(_running(b, now, stale_after_s) / s for b in peers if (s := b.service.service_s)),
        )
        if demand < QUIET_RPS and in_system == 0:
            continue
        known = [r for b in peers if (r := b.service.capacity_rps) is not None]
        if not others:
            return f"no other warm backend serves {model}"
        if not known:
            return f"the capacity of the other backends of {model} is not known yet"
        mean = sum(known) / len(known)
        cap = sum(r if (r := b.service.capacity_rps) is not None else mean for b in others)
        if demand > target_utilization * cap:
            return (
                f"{model}: {demand:.1f} req/s would load the other backends to "
                f"{demand / cap:.0%} of their {cap:.1f} req/s (at most "
                f"{target_utilization:.0%})"
            )
    return None


SERVING = frozenset({S.WARM, S.DRAINING, S.COOLDOWN})


def _fresh_load(b: Backend, now: float | None, stale_after_s: float) -> LoadSample | None:
    """``b``'s last scrape, or None when there is none or it is older than
    ``stale_after_s`` at ``now`` (None: any age)."""
    s = b.load
    if s is None or (now is not None and now - s.scraped_at > stale_after_s):
        return None
    return s


def _running(b: Backend, now: float | None, stale_after_s: float) -> float:
    """Requests running on ``b`` by its last fresh scrape (0 without one)."""
    s = _fresh_load(b, now, stale_after_s)
    return 0.0 if s is None else s.running


def _in_system(b: Backend, now: float | None, stale_after_s: float) -> float:
    """Requests running or queued on ``b`` by its last fresh scrape, never below the
    gateway's own requests in flight there."""
    s = _fresh_load(b, now, stale_after_s)
    return max(float(b.in_flight), 0.0 if s is None else s.waiting + s.running)
