"""The value types of a backend's record: its transitions, model cards, control-plane
record (what :class:`gateway.fleet.state.FleetState` owns), deferrals, and what the fleet
holds of a request open on it (:class:`Cuttable`). Declarative: no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.core.vocab import BackendState, Cut


@dataclass(slots=True, frozen=True)
class Transition:
    """One state change: wall-clock time (unix seconds), from, to, reason."""

    at: float
    from_state: BackendState
    to_state: BackendState
    reason: str


@dataclass(slots=True, frozen=True)
class ModelCard:
    """One entry of a backend's ``/v1/models``, kept whole so vLLM's fields survive."""

    id: str
    raw: dict[str, object]


class Cuttable(Protocol):
    """What the fleet holds of a request open on a backend: a way to end it early
    (:class:`gateway.proxy.relay.CutHandle` is the implementation)."""

    def cut(self, reason: Cut) -> None:
        """End the request now, for ``reason``."""


class Deferral(NamedTuple):
    """A due maintenance cycle held back because the others could not carry the load:
    the cycle kind, the monotonic time it was first deferred, and why."""

    cycle: str
    since: float
    reason: str


@dataclass(slots=True, frozen=True)
class ControlRecord:
    """The control-plane state of one backend: what :class:`gateway.fleet.state.FleetState`
    owns and its store keeps (the part replicas of a gateway would share). Times are
    monotonic seconds.

    ``hold``: kept out of rotation even when probes pass: ``admin_drain`` (until undrain),
    ``preempted`` / ``restarting`` (until the instance goes away, or ``hold_until``
    passes), ``gpu_fault`` (until undrained or the restart is seen). ``drained``: a manual
    drain finished (nothing in flight, out of rotation). ``maintenance``: the procedure
    running now (short/medium/long/drain/...). ``first_seen``: start of the cold-start
    timer; ``warm_since``: start of the slow-start ramp. ``restart_seen_after``:
    ``process_start_time_seconds`` before a restart hook (another value means it
    restarted). ``config_error``: the backend refused the gateway's own key."""

    state: BackendState
    hold: str | None
    hold_until: float | None
    restart_seen_after: float | None
    drained: bool
    drain_deadline: float | None
    warm_since: float | None
    first_seen: float | None
    maintenance: str | None
    deferred: Deferral | None
    config_error: str | None


@dataclass(frozen=True)
class Placement:
    """Where a backend runs: topology ``zone``, ``node``, ``capacity_type`` (``on-demand`` |
    ``spot``) and ``instance_type``. From its config, then from discovery (EndpointSlice and
    node labels) while it runs: :meth:`gateway.fleet.backend.Backend.placed`."""

    zone: str | None = None
    node: str | None = None
    capacity_type: str = "on-demand"
    instance_type: str | None = None

    @property
    def spot(self) -> bool:
        """Whether the provider may reclaim it at short notice."""
        return self.capacity_type == "spot"
