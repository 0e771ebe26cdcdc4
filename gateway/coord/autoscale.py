"""Fleet mode: one autoscaling answer for the whole fleet (issue 16, item 2).

Each gateway replica sees only the arrivals its load balancer gives it, so a forecast or a
TTFT tail of one replica is a part of the fleet's. The backends' gauges (replicas ready,
queues, KV cache) are scraped by every replica alike.

Keys (prefix ``autoscale``):

* ``autoscale:inputs``, a hash: replica id -> JSON ``{"at": store time, "models": {model:
  ArrivalInputs.as_dict()}}``, written by each replica every sync round. The round's
  script drops the entries of replicas the heartbeat no longer lists (as ``cap:demand``)
  and returns the rest; they are combined per model
  (:func:`gateway.autoscale.combine_inputs`: rates summed, the worst TTFT P99 among the
  replicas with enough first tokens).
* ``autoscale:decision``, a string: JSON ``{"by": replica id, "at": store time,
  "models": {model: Decision.as_dict()}}``, written by the **leader**, the lowest live
  replica id of the heartbeat list (every replica reads the same list, so they agree;
  when it dies the next lowest leads within ``coordination.replica_ttl_s``), with a TTL of
  :data:`FRESH_INTERVALS` decision intervals.

The other replicas serve the leader's decision while it is fresh (written within
:data:`FRESH_INTERVALS` x ``autoscale.interval_s`` of the store's clock), else their own,
and every replica holds the answers (``desired``) of the record it reads in its own
stabilization window (:meth:`SharedAutoscale.recent`, ``ModelAutoscaler.hold``): when the
lead moves (the leader died, or a replica with a lower id joined) the new leader's answer
does not fall before the fleet's scale-down cooldown has passed. A replica writes only
decisions it made after its first read of the store, so one that starts and leads at once
never publishes a decision that knew nothing of the fleet's recent answers.
Store down: nothing is read or written; the combined inputs go stale after
:data:`FRESH_INTERVALS` sync rounds (never used after the round that failed) and each
replica decides on its own inputs (``/autoscale`` says ``inputs: local`` and its own id in
``decided_by``). Nothing here is on the request path, and the loop never fails for it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.autoscale import ArrivalInputs, Decision, combine_inputs
from gateway.config import GatewayConfig
from gateway.coord.link import RedisLink
from gateway.coord.replicas import LIVE_ENTRIES, Replicas

log = logging.getLogger("gateway.coord")

FRESH_INTERVALS = 3
"""A leader's decision is served for this many decision intervals after it was written;
combined inputs are used for this many sync rounds after they were read."""

# KEYS[1]: the inputs hash, KEYS[2]: the decision. ARGV: this replica's id, its inputs,
# then the live replica ids. Writes its inputs, drops entries of replicas not alive,
# returns {the live entries flat, the decision (or false)}.
INPUTS = LIVE_ENTRIES + "return {out, redis.call('GET', KEYS[2])}\n"


class SharedAutoscale:
    """This replica's part (:class:`gateway.flow.autoscaling.SharedView`).

    ``local_inputs()``: this replica's inputs per model, now; ``own()``: its own last
    decisions and when it made them (unix seconds). ``clock``: monotonic seconds."""

    def __init__(
        self,
        cfg: GatewayConfig,
        link: RedisLink,
        replicas: Replicas,
        local_inputs: Callable[[], dict[str, ArrivalInputs]],
        own: Callable[[], tuple[dict[str, Decision], float]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.replicas = replicas
        self.local_inputs = local_inputs
        self.own = own
        self.clock = clock
        self.wall = wall
        self.decision_fresh_s = FRESH_INTERVALS * cfg.autoscale.interval_s
        self.inputs_fresh_s = FRESH_INTERVALS * cfg.coordination.sync_interval_s + (
            cfg.coordination.op_timeout_s
        )
        self._combined: dict[str, ArrivalInputs] | None = None
        self._read_at: float | None = None  # monotonic, of the last good round
        self._leader: tuple[str, float, dict[str, Decision]] | None = None
        self._first_read: float | None = None  # unix time of the first good read
        self._written_at = 0.0  # unix time of the own decisions last written
        self._script = link.client.register_script(INPUTS)

    @property
    def replica_id(self) -> str:
        return self.link.replica_id

    def leader_id(self) -> str:
        """The lowest live replica id (this one counted)."""
        return self.replicas.ids()[0]

    async def sync(self) -> None:
        """Write this replica's inputs, read the live replicas' and the decision; the
        leader writes its own decisions. Raises
        :class:`gateway.coord.link.CoordinationUnavailable` (the link is then down)."""
        me = self.link.replica_id
        mine = self.local_inputs()
        record = json.dumps(
            {"at": self.link.now(), "models": {m: i.as_dict() for m, i in mine.items()}}
        )
        keys = [self.link.key("autoscale", "inputs"), self.link.key("autoscale", "decision")]
        args: list[str | int] = [me, record, *self.replicas.ids()]
        flat, decision = await self.link.call(
            "autoscale", lambda c: self._script(keys, args, client=c)
        )
        parts: dict[str, list[ArrivalInputs]] = {}
        for i in range(0, len(flat), 2):
            rid = str(flat[i])
            models = mine if rid == me else _models(flat[i + 1])
            for model, inputs in models.items():
                parts.setdefault(model, []).append(inputs)
        self._combined = {m: combine_inputs(p) for m, p in parts.items()}
        self._read_at = self.clock()
        if self._first_read is None:
            self._first_read = self.wall()
        self._leader = self._read_decision(decision, me)
        if self.leader_id() == me:
            await self._write_own()

    def _read_decision(
        self, raw: Any, me: str
    ) -> tuple[str, float, dict[str, Decision]] | None:
        if not raw:
            return None
        try:
            o = json.loads(raw)
            by, at = str(o["by"]), float(o["at"])
            models = {str(m): Decision.from_dict(d) for m, d in o["models"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("autoscale: unreadable decision record in the store, ignored")
            return None
        if by == me:
            return None
        return by, at, models

    async def _write_own(self) -> None:
        decisions, at = self.own()
        if not decisions or at <= self._written_at:
            return
        if self._first_read is None or at < self._first_read:
            return  # decided before it had read the fleet's record (module docstring)
        body = json.dumps(
            {
                "by": self.link.replica_id,
                "at": self.link.now(),
                "models": {m: d.as_dict() for m, d in decisions.items()},
            }
        )
        ttl_ms = max(1, int(self.decision_fresh_s * 1000))
        key = self.link.key("autoscale", "decision")
        await self.link.call("autoscale", lambda c: c.set(key, body, px=ttl_ms))
        self._written_at = at

    # ---- SharedView ---------------------------------------------------------------------
    def fleet_inputs(self) -> dict[str, ArrivalInputs] | None:
        """The combined inputs of the last round, while fresh and the store answers."""
        if not self.link.up or self._read_at is None:
            return None
        if self.clock() - self._read_at > self.inputs_fresh_s:
            return None
        return self._combined

    def recent(self) -> tuple[float, dict[str, Decision]] | None:
        """``(age in seconds, decisions)`` of the last decision record another replica
        wrote, whoever leads now, while the store answers and the record is fresh (store
        clock); None otherwise. Its answers go into this replica's stabilization window
        (module docstring)."""
        rec = self._leader
        if rec is None or not self.link.up:
            return None
        age = self.link.now() - rec[1]
        if age > self.decision_fresh_s:
            return None
        return max(0.0, age), rec[2]

    def leader(self) -> tuple[str, float, dict[str, Decision]] | None:
        """Another replica's decision while it leads, the store answers and the record is
        fresh (store clock); None otherwise."""
        rec = self._leader
        if rec is None or self.recent() is None:
            return None
        if self.leader_id() != rec[0]:  # the lead moved: the next one decides afresh
            return None
        return rec


def _models(raw: Any) -> dict[str, ArrivalInputs]:
    """Another replica's stored inputs; an unreadable record counts as none."""
    try:
        o = json.loads(raw)
        return {str(m): ArrivalInputs.from_dict(d) for m, d in o["models"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
