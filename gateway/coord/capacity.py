"""Capacity is not multiplied by the number of replicas (issue 14, item 5).

One gateway bounds what it sends the backends: the admission scheduler's ``max_in_flight``
(the fleet's ``sum(max_num_seqs) x admission.in_flight_per_seq``) and, with the batcher, the
places per backend (``max_num_seqs x batcher.in_flight_per_seq``). N replicas each applying
that bound would send N times as much. Here every replica reports its demand each sync round
and takes a share of each bound from it (:func:`gateway.traffic.shares.split_classes`: a
floor of one slot, high-priority waiters first, then in proportion to demand, the shares
summing to the bound; it grows only into slots the others neither hold nor were given),
applied through the flow's setters (``AdmissionGate.set_capacity_share``,
``Placement.set_shares``). The shares are computed from what the round read, never on the
request path.


Key (prefix ``cap``): ``cap:demand``, a hash: replica id -> its report (JSON: ``d`` demand
by class: high running and queued, unsmoothed; normal and low running plus normal queued,
and low queued, both smoothed; ``h`` requests
holding a scheduler slot; ``s`` the share it applied), as of its last round. Only the
replicas the heartbeat lists as alive are counted (a dead replica's entry is ignored and
dropped), so a replica that leaves gives its share back within
``coordination.replica_ttl_s``.


The bound (``docs/architecture.md``, "Fleet mode"): the shares sum to the capacity, but a
share that shrinks keeps the requests already running above it until they end (nothing is
cut), and a replica acts on demands one sync round old; so the total in flight may exceed
the capacity for about one request's service time after the load moves between replicas.
Store down: the last shares stay in force (the replicas alive then, each holding its share:
the total stays within the capacity); resync: the next round reports the demand again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gateway.coord.link import RedisLink
from gateway.coord.replicas import LIVE_ENTRIES, Replicas
from gateway.fleet.backend import Backend
from gateway.metrics import GatewayMetrics
from gateway.traffic.shares import split_classes

log = logging.getLogger("gateway.coord")

# KEYS[1]: the demand hash. ARGV: this replica's id, its demand, then the live replica ids.
# Writes its demand, drops entries of replicas not alive, returns the rest flat.
DEMAND = LIVE_ENTRIES + "return out\n"

# KEYS[1]: the demand hash. ARGV: this replica's id, its target share (slots), the capacity,
# then the live replica ids. Grants min(target, capacity - what the other live replicas hold
# or were granted: max(share, held) of each report), records it as this replica's share and
# returns it. Redis runs one script at a time, so two replicas growing in the same round
# cannot both take the same freed slots (they did when each clamped against the reports it
# had read before the other's claim: the fleet's total then stayed over the capacity for as
# long as the requests so admitted ran).
CLAIM = """
local me = ARGV[1]
local target = tonumber(ARGV[2])
local total = tonumber(ARGV[3])
local live = {}
for i = 4, #ARGV do live[ARGV[i]] = true end
local others = 0
local mine = nil
local all = redis.call('HGETALL', KEYS[1])
for j = 1, #all, 2 do
  local ok, r = pcall(cjson.decode, all[j + 1])
  if ok and type(r) == 'table' then
    if all[j] == me then
      mine = r
    elseif live[all[j]] then
      others = others + math.max(tonumber(r.s) or 0, tonumber(r.h) or 0)
    end
  end
end
local granted = math.max(0, math.min(target, total - others))
if mine ~= nil then
  mine.s = granted
  redis.call('HSET', KEYS[1], me, cjson.encode(mine))
end
return granted
"""


# Weight of the newest demand reading in the smoothed demand (per sync round): about a
# second of memory at the default 0.25 s round.
DEMAND_ALPHA = 0.3


class CapacityShares:
    """This replica's share of the fleet's capacity, refreshed every sync round.

    ``demand``: requests held here now by class, most urgent first (high running and
    queued; normal and low running plus normal queued; low queued:
    :func:`gateway.traffic.shares.split_classes` meets a class across the replicas before
    the next); ``held``: those holding a scheduler slot.
    ``total``: the slots one gateway allows in all (``AdmissionGate.fleet_capacity``; None:
    unbounded, nothing to split). ``backend_limit``: the places one gateway allows per
    backend. The flow's setters: ``set_total(share, smoothed target)`` and
    ``set_per_backend`` (None without the batcher)."""

    def __init__(
        self,
        link: RedisLink,
        replicas: Replicas,
        metrics: GatewayMetrics,
        demand: Callable[[], tuple[int, int, int]],
        held: Callable[[], int],
        total: int | None,
        set_total: Callable[[int, float], None],
        backends: Callable[[], Iterable[Backend]],
        backend_limit: Callable[[Backend], float] | None = None,
        set_per_backend: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.link = link
        self.replicas = replicas
        self.metrics = metrics
        self.demand = demand
        self.held = held
        self.total = total
        self.set_total = set_total
        self.backends = backends
        self.backend_limit = backend_limit
        self.set_per_backend = set_per_backend
        self.reports: dict[str, Report] = {}  # as last read (live replicas)
        self.share: int | None = None  # this replica's slots, as last applied
        self.per_backend: dict[str, int] = {}
        self._demand: list[float] | None = None  # smoothed demand per class (requests)
        self._rate_slots: float | None = None  # smoothed target share (slots)
        self._script = link.client.register_script(DEMAND)
        self._claim = link.client.register_script(CLAIM)
        if total is not None:
            metrics.capacity_share.set(total)

    async def sync(self) -> None:
        """Report the demand here, read the live replicas', apply the shares. Raises
        :class:`gateway.coord.link.CoordinationUnavailable` (the last shares stay)."""
        me = self.link.replica_id
        now = [float(x) for x in self.demand()]
        # smoothed over rounds (EWMA, DEMAND_ALPHA): a queue's round-to-round jitter would
        # otherwise move slots back and forth, and every move is a transient over the bound
        # (the high class is taken as it is: its running requests make it a steady count,
        # and slots it no longer uses go back to the other classes in the next round)
        old = self._demand
        d = now if old is None else [
            x if k == 0 else o + DEMAND_ALPHA * (x - o)
            for k, (o, x) in enumerate(zip(old, now, strict=True))
        ]
        self._demand = d
        mine = Report(tuple(round(x, 2) for x in d), self.held(), self.share)
        args: list[str | int] = [me, mine.dumps(), *self.replicas.ids()]
        flat: list[Any] = await self.link.call(
            "capacity", lambda c: self._script([self.link.key("cap", "demand")], args, client=c)
        )
        reports = {str(flat[i]): Report.loads(str(flat[i + 1])) for i in range(0, len(flat), 2)}
        reports[me] = mine
        self.reports = reports
        target = None
        granted = None
        if self.total is not None:
            target = split_classes(self.total, {r: rep.demand for r, rep in reports.items()})[me]
            # grow only into slots the others do not hold: their share, or what they still
            # run above a share that shrank, as the store has them now (one atomic claim)
            total = self.total
            claim_args: list[str | int] = [me, target, total, *reports]
            raw = await self.link.call(
                "capacity",
                lambda c: self._claim([self.link.key("cap", "demand")], claim_args, client=c),
            )
            granted = int(raw)
        self.apply(target, granted)

    def apply(self, target: int | None, granted: int | None) -> None:
        """Set this replica's share: ``target``, its part of the split of :attr:`reports`,
        as far as ``granted`` (slots the store's claim left it); both None without a
        capacity to split (:attr:`total` None): only the per-backend places are set."""
        me = self.link.replica_id
        demands = {r: rep.demand for r, rep in self.reports.items()}
        if self.total is not None and target is not None and granted is not None:
            share = max(0, min(target, granted))
            if share != self.share:
                log.debug("capacity share %d of %d (target %d, %d replicas)", share,
                          self.total, target, len(demands))
            self.share = share
            # the predictions' capacity: the target, smoothed (the applied share dips while
            # the others hand slots over, which is no change in this replica's service rate)
            r = self._rate_slots
            self._rate_slots = target if r is None else r + DEMAND_ALPHA * (target - r)
            self.set_total(share, self._rate_slots)
            self.metrics.capacity_share.set(share)
        if self.backend_limit is not None and self.set_per_backend is not None:
            per: dict[str, int] = {}
            for b in self.backends():
                limit = self.backend_limit(b)
                if limit != float("inf"):
                    per[b.id] = split_classes(int(limit), demands, salt=b.id)[me]
            self.per_backend = per
            self.set_per_backend(per)


@dataclass(frozen=True, slots=True)
class Report:
    """What one replica said in its last round: ``demand`` per class (requests: high
    running and queued; normal and low running plus normal queued; low queued), ``held``
    (requests holding one of the scheduler's slots) and ``share`` (the bound it applied;
    None before its first share)."""

    demand: tuple[float, ...]
    held: int
    share: int | None

    def dumps(self) -> str:
        return json.dumps({"d": self.demand, "h": self.held, "s": self.share})

    @classmethod
    def loads(cls, raw: str) -> Report:
        """A stored report; an unreadable one counts as idle (demand 0, holding nothing,
        no share yet)."""
        try:
            o = json.loads(raw)
            share = o.get("s")
            demand = tuple(float(x) for x in o["d"])
            return cls(demand, int(o["h"]), None if share is None else int(share))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls((0.0,), 0, None)
