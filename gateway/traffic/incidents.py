"""The recent incidents the status page lists (pure: times are passed in): breaker trips,
drains, backends gone unhealthy, canary rollbacks and config rollbacks, newest last, at
most ``capacity`` kept (the oldest dropped first).

Fed by the owners' own reports (:mod:`gateway.flow.status`): the fleet state's transition
listener, the breaker-trip and config-reload counters, the rollouts' decision history.
Subjects are backend ids and model names, never URLs or keys.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

KINDS = ("breaker_trip", "drain", "unhealthy", "rollout_rollback", "config_rollback")
"""The kinds of incident, as they appear in ``/status.json``."""


@dataclass(frozen=True, slots=True)
class Incident:
    """One incident: ``at`` (Unix seconds), ``kind`` (:data:`KINDS`), ``subject`` (a
    backend id, a model, or ``config``), ``detail`` (the owner's reason)."""

    at: float
    kind: str
    subject: str
    detail: str

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {"at": self.at, "kind": self.kind, "subject": self.subject,
                "detail": self.detail}


class IncidentLog:
    """The last ``capacity`` incidents, in the order they were recorded."""

    def __init__(self, capacity: int = 100) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._items: deque[Incident] = deque(maxlen=capacity)

    def record(self, at: float, kind: str, subject: str, detail: str) -> Incident:
        """Keep one incident (``kind`` one of :data:`KINDS`, else ``ValueError``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown incident kind {kind!r}")
        item = Incident(at, kind, subject, detail)
        self._items.append(item)
        return item

    def recent(self, limit: int | None = None) -> list[Incident]:
        """The newest ``limit`` incidents (all kept: None), newest first."""
        items = list(reversed(self._items))
        return items if limit is None else items[:limit]
