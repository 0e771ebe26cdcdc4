"""What a spot interruption notice does (:class:`SpotNotices`): it is counted, its zone's
spot health score drops (:class:`gateway.routing.spot.ZoneScores`, the score's one writer is
here), and the backends on the noticed node are preempted.

Notices come from the Kubernetes node watch (taints and conditions set by
aws-node-termination-handler, Karpenter's disruption, GKE preemption, through
:class:`gateway.fleet.discovery.DiscoverySink`'s ``spot_notice``) and from
``POST /admin/zones/{zone}/notice`` (:mod:`gateway.api.zones`) for anything else.

* **Counted** in ``gateway_spot_interruptions_total{zone,instance_type}`` (``unknown`` when
  neither the notice nor the node's backends say).
* **The zone's score** is multiplied by ``1 - spot.notice_penalty`` (module docstring of
  :mod:`gateway.routing.spot`), which moves new traffic off the zone's remaining spot
  backends while it recovers over ``spot.half_life_s``.
* **Preemption**: every backend placed on ``notice.node`` (spot or not: the node goes away)
  is preempted as ``POST /admin/backends/{id}/preempt`` does
  (:meth:`gateway.fleet.drain.Drains.start_drain`): no new requests, in-flight ones finish
  within ``lifecycle.preempt_deadline_s`` (30 s), then ``cold``, held out until the
  instance goes away or ``lifecycle.preempt_hold_s``. A notice **without a node** (a
  provider's zone-wide or instance-type warning) preempts nothing: which instance goes is not
  known, so only the score drops and the zone's spot backends keep a reduced share.
* **A node known to be on-demand** (``notice.capacity_type``, from its labels): the
  handlers' taints also mark nodes that go for other reasons than a spot reclaim (Karpenter's
  ``karpenter.sh/disrupted`` for consolidation, drift and expiry; aws-node-termination-
  handler's ASG scale-in): its backends are preempted (the node goes), but it is not counted
  as a spot interruption and the zone's spot score is unchanged, since it says nothing about
  the zone's spot capacity. (A spot node consolidated by Karpenter cannot be told from a
  reclaimed one by its taint: it counts.)
* **Idempotent per node**: a notice for a node already noticed within
  ``lifecycle.preempt_hold_s`` (the time its preemption holds its backends out) is a
  *repeat* (a node watch that reports the same taint twice, or the same node from an admin
  and from Kubernetes): nothing is counted and the score does not drop again, but the node's
  backends that are back in rotation (undrained by an operator since) are preempted again:
  the node is still going away, and a backend already preempted is left as it is. Notices
  without a node are never repeats.

In fleet mode an admin notice is shared by :mod:`gateway.coord.notices`: every replica applies
it once (counts it, drops its own copy of the score) and preempts through the operator's op
records; a Kubernetes notice is seen by every replica's own node watch and applied locally.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.fleet.backend import Backend
from gateway.fleet.discovery import SpotNotice
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.routing.spot import ZoneScores

log = logging.getLogger("gateway.fleet")

UNKNOWN = "unknown"
"""The metric label of a zone or instance type nobody said."""


@dataclass(frozen=True, slots=True)
class NoticeOutcome:
    """What one notice did. ``zone`` / ``instance_type``: as counted (from the notice, else
    from the node's backends; None when unknown); ``score_before`` / ``score``: the zone's
    score in [``min_score``, 1] before and after (None without a zone); ``preempted``: ids of
    the backends whose preemption this notice started; ``on_node``: ids of every backend
    placed on the node; ``repeat``: the node was noticed within ``preempt_hold_s``: not
    counted, the score unchanged; ``preempted`` then holds only backends that were back in
    rotation."""

    zone: str | None
    node: str | None
    instance_type: str | None
    reason: str
    score_before: float | None
    score: float | None
    preempted: tuple[str, ...]
    on_node: tuple[str, ...]
    repeat: bool


class SpotNotices:
    """Applies spot interruption notices to ``fleet`` (module docstring): counts them in
    ``metrics``, drops the zone's score in ``scores`` (its only writer), preempts through
    ``drains``. ``cfg``: ``lifecycle.preempt_deadline_s`` / ``preempt_hold_s``; ``clock``:
    monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        fleet: Fleet,
        drains: Drains,
        scores: ZoneScores,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.drains = drains
        self.scores = scores
        self.metrics = metrics
        self.clock = clock
        self._noticed: dict[str, float] = {}  # node -> until when a notice is a repeat

    def on_node(self, node: str | None) -> list[Backend]:
        """The backends placed on ``node`` (none for None), in fleet order."""
        if node is None:
            return []
        return [b for b in self.fleet if b.placement.node == node]

    def is_repeat(self, node: str | None, now: float | None = None) -> bool:
        """Whether a notice for ``node`` now would be a repeat (noticed within
        ``lifecycle.preempt_hold_s``)."""
        if node is None:
            return False
        return self._noticed.get(node, -math.inf) > (self.clock() if now is None else now)

    def notice(
        self,
        notice: SpotNotice,
        preempt: bool = True,
        deadline_s: float | None = None,
        at: float | None = None,
    ) -> NoticeOutcome:
        """Apply ``notice`` (module docstring). ``preempt``: also preempt the node's backends
        here (False: fleet mode, where the op records do it on every replica);
        ``deadline_s``: their drain deadline (default ``lifecycle.preempt_deadline_s``);
        ``at``: when the notice was given (monotonic seconds, default now; a replica catching
        up with the fleet's notices gives an earlier one). Never raises for an unknown zone
        or node."""
        now = self.clock()
        at = now if at is None else min(at, now)
        backends = self.on_node(notice.node)
        zone = notice.zone or next((b.placement.zone for b in backends if b.placement.zone), None)
        itype = notice.instance_type or next(
            (b.placement.instance_type for b in backends if b.placement.instance_type), None
        )
        ids = tuple(b.id for b in backends)
        before = None if zone is None else self.scores.score(zone, now)
        preempted: list[str] = []
        if preempt:  # a repeat too: a backend undrained since the first notice goes again
            left = self.cfg.lifecycle.preempt_deadline_s if deadline_s is None else deadline_s
            for b in backends:
                if self.drains.start_drain(b, left, preempt=True):
                    preempted.append(b.id)
        if notice.capacity_type == "on-demand":  # the node goes, the spot pool says nothing
            log.warning(
                "node %s (on-demand, zone %s) is going away (%s): preempted: %s; not a spot "
                "interruption (not counted, zone score unchanged)", notice.node or "-",
                zone or UNKNOWN, notice.reason, ", ".join(preempted) or "none",
            )
            return NoticeOutcome(zone, notice.node, itype, notice.reason, before, before,
                                 tuple(preempted), ids, repeat=False)
        if self.is_repeat(notice.node, now):
            if preempted:
                log.warning("spot interruption notice (%s) for node %s again: preempted "
                            "again: %s", notice.reason, notice.node, ", ".join(preempted))
            return NoticeOutcome(zone, notice.node, itype, notice.reason, before, before,
                                 tuple(preempted), ids, repeat=True)
        if notice.node is not None:
            self._noticed = {n: t for n, t in self._noticed.items() if t > now}
            self._noticed[notice.node] = at + self.cfg.lifecycle.preempt_hold_s
        self.metrics.spot_interruptions.labels(zone or UNKNOWN, itype or UNKNOWN).inc()
        after = None if zone is None else self.scores.notice(zone, at)
        log.warning(
            "spot interruption notice (%s): zone %s, node %s, instance type %s; zone score "
            "%s -> %s; preempted: %s",
            notice.reason, zone or UNKNOWN, notice.node or "-", itype or UNKNOWN,
            _fmt(before), _fmt(after), ", ".join(preempted) or "none",
        )
        return NoticeOutcome(zone, notice.node, itype, notice.reason, before, after,
                             tuple(preempted), ids, repeat=False)


def _fmt(score: float | None) -> str:
    return "-" if score is None else f"{score:.3f}"
