"""Cold starts as the gateway sees them: ``gateway_cold_start_seconds{model,gpu_type,stage}``
and the recent mean per model that the autoscaler's ahead paradigm plans with.

One cold start runs from the moment a backend is first seen (discovery added it, or the
gateway started with it) or went ``cold`` / ``unhealthy`` (a restart, a crash) until it is
``warm`` again: :class:`gateway.fleet.state.FleetState` keeps that start in the backend's
record (``first_seen``). Its stages, as far as the gateway can see them:

* ``load``: start -> its first passing health probe (``cold`` / ``unhealthy`` ->
  ``warming``): the server process is up and its model loaded (vLLM's ``/health``
  answers 200 only then);
* ``warmup``: first passing probe -> ``warm`` (warm-up batches, calibration);
* ``total``: the two together.

All three are observed when it turns warm (its models are known by then), once per model it
serves (``unknown`` while it lists none), labelled with its node's instance type
(``Backend.placement.instance_type``, else ``unknown``). Only cold starts that began after
the gateway's own start count in :meth:`ColdStarts.mean_s` (a backend found at start was
not seen starting: its "cold start" is the gateway's); they are the arrivals that discovery
saw and the restarts. The mean is over the last :data:`RECENT` totals of the model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Change, Fleet
from gateway.fleet.records import Transition
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

S = BackendState

RECENT = 8
"""Totals kept per model for :meth:`ColdStarts.mean_s` (the newest)."""

UNKNOWN = "unknown"


class ColdStarts:
    """The owner of the cold-start measurements (module docstring); listens to ``state``'s
    transitions and ``fleet``'s membership. ``clock``: monotonic seconds, the one
    ``FleetState`` stamps ``first_seen`` with."""

    def __init__(
        self,
        fleet: Fleet,
        state: FleetState,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        # backends found at start, until their first warm (not counted in the mean)
        self._at_start: set[str] = {b.id for b in fleet.backends}
        # backend id -> (start, first passing probe): the open cold start's stages
        self._open: dict[str, tuple[float, float | None]] = {}
        self.recent: dict[str, deque[float]] = {}  # model -> the newest totals (seconds)
        state.listen(self.on_transition)
        fleet.on_change(self.on_change)

    def on_change(self, backend: Backend, change: Change) -> None:
        """Membership: a removed backend's open cold start is dropped."""
        if change == "removed":
            self._open.pop(backend.id, None)
            self._at_start.discard(backend.id)

    def on_transition(self, backend: Backend, t: Transition) -> None:
        """One transition of ``backend`` (after its record changed)."""
        now = self.clock()
        to = t.to_state
        if to is S.WARMING:
            start = backend.first_seen
            if start is None:  # back from draining / cooldown: no cold start open
                return
            opened = self._open.get(backend.id)
            if opened is None or opened[0] != start:
                self._open[backend.id] = (start, now)  # its first passing probe
            return
        if to is S.WARM:
            opened = self._open.pop(backend.id, None)
            at_start = backend.id in self._at_start
            self._at_start.discard(backend.id)
            if opened is None:
                return
            start, loaded = opened
            self._observe(backend, start, loaded if loaded is not None else now, now, at_start)

    def _observe(
        self, backend: Backend, start: float, loaded: float, warm: float, at_start: bool
    ) -> None:
        gpu = backend.placement.instance_type or UNKNOWN
        total = max(0.0, warm - start)
        stages = (("load", max(0.0, loaded - start)), ("warmup", max(0.0, warm - loaded)),
                  ("total", total))
        for model in backend.models or (UNKNOWN,):
            for stage, seconds in stages:
                self.metrics.cold_start.labels(model, gpu, stage).observe(seconds)
            if not at_start:
                self.recent.setdefault(model, deque(maxlen=RECENT)).append(total)

    def mean_s(self, model: str) -> float | None:
        """Mean of ``model``'s recent cold-start totals (seconds; cold starts that began
        after the gateway's start), None before one was measured."""
        r = self.recent.get(model)
        return sum(r) / len(r) if r else None

    def forget_model(self, model: str) -> None:
        """No backend serves ``model`` any more: drop its recent totals."""
        self.recent.pop(model, None)
