"""Backend lifecycle state machine (pure: no I/O; time is passed in).

States and the legal moves between them (DESIGN.md, "Backend states")::

    cold -> warming -> warm -> draining -> cooldown -> warming/warm
    draining -> warm (undrain) | cold (restart hook)      any -> unhealthy
    unhealthy -> warming | cold

Maintenance cycles (seed 000), all periods configurable (:class:`LifecycleConfig`):

* short (5 min): an application probe; no traffic change unless it fails;
* medium (30 min or 10,000 requests served, whichever first): drain -> reset prefix cache
  -> rest -> calibration -> slow-start return;
* long (4 h): drain -> restart hook -> cold -> warming.

:func:`initial_cycle_clock` spreads first due times over the period so backends do not
all come due together, and :func:`may_take_out` keeps at most ``max_unavailable`` backends
of a model out of rotation and never its last warm one (Kubernetes' ``maxUnavailable``
with the percentage rounded down, at least 1). A scheduled cycle that takes a backend out
also waits until the others can carry the load (:func:`can_carry_without`): maintenance
never costs capacity the load needs; it is deferred to the next quiet moment instead.

Every change goes through :func:`apply_transition`, which rejects illegal moves with
:class:`IllegalTransition` and appends to the backend's history. Health decisions
(:func:`after_probe`) are pure functions of the counters and the
thresholds in :class:`gateway.config.HealthConfig`: fail after ``fail_threshold`` failed
probes in a row, recover after ``recover_threshold`` passing ones (Envoy's active health
checking uses the same unhealthy/healthy threshold pair).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gateway.config import HealthConfig, LifecycleConfig
from gateway.core.samples import LoadSample
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend, Transition

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


def apply_transition(backend: Backend, to: BackendState, reason: str, now: float) -> Transition:
    """Move ``backend`` to ``to``; ``now`` is wall-clock unix seconds (for the history).

    Returns the :class:`Transition` (the caller logs it and counts it in metrics).
    Raises :class:`IllegalTransition` for a move outside :data:`LEGAL`.
    """
    check_transition(backend.state, to)
    t = Transition(at=now, from_state=backend.state, to_state=to, reason=reason)
    backend.state = to
    if to is S.UNHEALTHY:
        # whatever made it unhealthy (probes, warm-up, breaker, stall, GPU), it comes back
        # only after ``recover_threshold`` passing probes from now
        backend.consecutive_probe_successes = 0
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
      ``warming`` after ``cfg.recover_threshold`` passes in a row; never while the backend
      is held out of rotation (``backend.hold``: an admin drain, a spot preemption or a
      restart that has not happened yet).
    """
    if ok:
        backend.consecutive_probe_failures = 0
        backend.consecutive_probe_successes += 1
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
    backend.consecutive_probe_successes = 0
    backend.consecutive_probe_failures += 1
    if (
        backend.state in (S.WARMING, S.WARM, S.DRAINING, S.COOLDOWN)
        and backend.consecutive_probe_failures >= cfg.fail_threshold
    ):
        return Decision(S.UNHEALTHY, "probe_failed")
    return None


# ---- slow start --------------------------------------------------------------------------
# ---- maintenance cycles --------------------------------------------------------------------
class CycleKind(StrEnum):
    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"


@dataclass(slots=True)
class CycleClock:
    """When each cycle of one backend is next due (monotonic seconds), and the request count
    at its last medium cycle (for the every-N-requests trigger)."""

    next_short: float
    next_medium: float
    next_long: float
    requests_at_medium: int = 0


def _first(now: float, every: float, index: int, count: int) -> float:
    if every <= 0:
        return math.inf
    return now + every * (index + 1) / max(1, count)


def initial_cycle_clock(index: int, count: int, now: float, cfg: LifecycleConfig) -> CycleClock:
    """First due times of backend ``index`` of ``count``, spread evenly over each period."""
    return CycleClock(
        next_short=_first(now, cfg.short.every_s, index, count),
        next_medium=_first(now, cfg.medium.every_s, index, count),
        next_long=_first(now, cfg.long.every_s, index, count),
    )


def due_cycle(
    clock: CycleClock, now: float, requests_served: int, cfg: LifecycleConfig
) -> CycleKind | None:
    """The most thorough cycle now due for one backend (long > medium > short), or None."""
    if now >= clock.next_long:
        return CycleKind.LONG
    every_n = cfg.medium.every_requests
    if now >= clock.next_medium or (
        every_n > 0 and requests_served - clock.requests_at_medium >= every_n
    ):
        return CycleKind.MEDIUM
    if now >= clock.next_short:
        return CycleKind.SHORT
    return None


def cycle_started(
    clock: CycleClock, kind: CycleKind, now: float, requests_served: int, cfg: LifecycleConfig
) -> None:
    """Book a started cycle: its next due time moves one period on. A long cycle also
    counts as a medium and a short one (it does more than both)."""
    inf = math.inf
    if kind is CycleKind.LONG:
        clock.next_long = now + cfg.long.every_s if cfg.long.every_s > 0 else inf
    if kind in (CycleKind.LONG, CycleKind.MEDIUM):
        clock.next_medium = now + cfg.medium.every_s if cfg.medium.every_s > 0 else inf
        clock.requests_at_medium = requests_served
    clock.next_short = now + cfg.short.every_s if cfg.short.every_s > 0 else inf


def max_unavailable(model_backends: int, cfg: LifecycleConfig) -> int:
    """How many of a model's ``model_backends`` may be out of rotation at once."""
    if cfg.max_unavailable is not None:
        return cfg.max_unavailable
    return max(1, math.floor(0.25 * model_backends))


def may_take_out(backend: Backend, fleet: Sequence[Backend], cfg: LifecycleConfig) -> bool:
    """Whether a maintenance cycle may take ``backend`` out of rotation now.

    For every model it serves: after taking it out, at least one *other* backend of the
    model must be warm, and no more than :func:`max_unavailable` of the model's backends may
    be out of rotation (any state but ``warm`` counts as out: draining, cooldown, warming,
    cold, unhealthy). Only a warm backend is taken out.
    """
    if backend.state is not S.WARM or not backend.models:
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
