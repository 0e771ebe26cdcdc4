"""Thermal cooldown decisions: when a hot backend is sent to rest, when its rest ends
(pure: no I/O, times passed in as monotonic seconds).

The live gateway's GPU telemetry loop (:mod:`gateway.fleet.gpu_monitor`) and the fleet
simulator (:mod:`gateway.sim.fleet`, simulated time) both decide with these functions; the
lifecycle carries the decision out (drain, rest, return warm through the slow-start ramp),
staggered like every cycle (:func:`gateway.fleet.lifecycle.may_take_out`).

* :func:`cooldown_due`: thermal routing on, the backend ``warm`` (in rotation) and its GPUs'
  tier ``hot`` (>= ``hot_c``, latched until a reading below ``resume_c``).
* :func:`cooldown_done`: the rest may end: a fresh reading below ``resume_c`` after at
  least ``cooldown_s`` of rest, or ``max_cooldown_s`` (the cap) whatever the readings.
* :func:`rest_over`: :func:`cooldown_done`, and when it says True, the tracker's hot latch
  is re-read (:meth:`~gateway.routing.thermal.ThermalTracker.end_cooldown`) as the backend
  returns: the end condition both callers give the rest.
"""

from __future__ import annotations

from gateway.config import ThermalConfig
from gateway.core.vocab import BackendState
from gateway.routing.thermal import ThermalStatus, ThermalTier, ThermalTracker

__all__ = ["cooldown_done", "cooldown_due", "rest_over"]


def cooldown_due(state: BackendState, status: ThermalStatus, cfg: ThermalConfig) -> bool:
    """Whether a backend in ``state`` whose GPUs read ``status`` now should be sent to a
    thermal cooldown: thermal routing enabled, the backend ``warm``, its tier ``hot``. A
    backend without GPU telemetry (tier ``unknown``) or with stale telemetry never is.
    Whether it may be taken out now (staggering) is the lifecycle's question."""
    return cfg.enabled and state is BackendState.WARM and status.tier is ThermalTier.HOT


def cooldown_done(tracker: ThermalTracker, rested_s: float, now: float, cfg: ThermalConfig) -> bool:
    """Whether a thermal cooldown that has rested ``rested_s`` seconds may end at ``now``:
    a fresh reading below ``resume_c`` and at least ``cooldown_s`` of rest, or the cap
    ``max_cooldown_s`` reached (missing telemetry never counts as cooled down). Reads only;
    :func:`rest_over` is the end condition that also resets the hot latch."""
    if rested_s >= cfg.max_cooldown_s:
        return True
    if rested_s < cfg.cooldown_s or not tracker.fresh(now):
        return False
    s = tracker.latest
    return s is not None and s.temp_c is not None and s.temp_c < cfg.resume_c


def rest_over(tracker: ThermalTracker, rested_s: float, now: float, cfg: ThermalConfig) -> bool:
    """:func:`cooldown_done`; when True, also ends the tracker's cooldown (the hot latch is
    re-read from the last temperature: the cap may release a backend between ``resume_c``
    and ``hot_c``, and it returns warm, not hot). Call once per check of a resting backend."""
    if not cooldown_done(tracker, rested_s, now, cfg):
        return False
    tracker.end_cooldown()
    return True
