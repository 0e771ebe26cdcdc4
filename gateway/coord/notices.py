"""Spot interruption notices, fleet-wide (issue 15, item 2): an admin notice sent to one
replica is applied by every replica, each once.

``POST /admin/zones/{zone}/notice`` on any replica (:mod:`gateway.api.zones`) preempts the
node's backends through the operator's op records (:mod:`gateway.coord.operator`: a standing
``preempt`` record per backend, so every replica drains its own requests to the shared
deadline, a replica that starts later holds them out too, and an undrain replaces it), then
writes a *notice record* here (:data:`SUBMIT`, stamped with the store's clock) and applies it
at once. Every other replica reads the records in its sync round (``HGETALL``) and applies
each one it has not applied yet, oldest first: it counts the notice in its own
``gateway_spot_interruptions_total`` and drops its own copy of the zone's score
(:meth:`gateway.fleet.spot.SpotNotices.notice` with ``preempt=False``: the op records do
that), as of the notice's store time, within ``coordination.sync_interval_s +
op_timeout_s``. The records stay ``10 x spot.half_life_s`` (a notice's deficit is then below
:data:`gateway.routing.spot.RECOVERED`; at least ``lifecycle.preempt_hold_s``), so a replica
that starts later takes the scores over too; the script that writes one drops the older.

Notices from the Kubernetes node watch are not written here: every replica runs its own
watch and sees the same taint. **Store down**: the admin API refuses a notice (503, nothing
changes on any replica, as for every admin write); nothing to write back when it answers
again (:meth:`SharedNotices.sync` is also the resync).

Key: ``<ns>:ops:notices`` (hash: notice id -> record JSON).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.fleet.discovery import SpotNotice
from gateway.fleet.spot import NoticeOutcome, SpotNotices

log = logging.getLogger("gateway.coord")

# KEYS: notices hash. ARGV: notice id, zone, node ('' none), instance type ('' none), replica
# id, reason, how long records are kept (seconds). Stamps the record with the store's clock,
# drops records older than the keep time; returns the record's JSON.
SUBMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rec = {id = ARGV[1], zone = ARGV[2], by = ARGV[5], at = now, reason = ARGV[6]}
if ARGV[3] ~= '' then rec.node = ARGV[3] end
if ARGV[4] ~= '' then rec.instance_type = ARGV[4] end
local out = cjson.encode(rec)
redis.call('HSET', KEYS[1], ARGV[1], out)
local oldest = now - tonumber(ARGV[7])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ok, r = pcall(cjson.decode, all[i + 1])
  if (not ok) or type(r.at) ~= 'number' or r.at < oldest then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class NoticeRecord:
    """One admin notice as the fleet shares it. ``at``: unix seconds of the store's clock;
    ``by``: the replica that took it; ``id``: unique per notice (a replica applies each
    once)."""

    id: str
    zone: str
    by: str
    at: float
    reason: str = "admin"
    node: str | None = None
    instance_type: str | None = None

    @classmethod
    def parse(cls, raw: str) -> NoticeRecord | None:
        """A record from its JSON (None: unreadable)."""
        try:
            d = json.loads(raw)
            node, itype = d.get("node"), d.get("instance_type")
            return cls(
                id=str(d["id"]), zone=str(d["zone"]), by=str(d.get("by", "")),
                at=float(d["at"]), reason=str(d.get("reason", "admin")),
                node=None if node is None else str(node),
                instance_type=None if itype is None else str(itype),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    @property
    def notice(self) -> SpotNotice:
        """The notice it carries."""
        return SpotNotice(self.zone, self.node, self.instance_type, self.reason)


class SharedNotices:
    """One replica's part in fleet-wide spot notices (module docstring): writes admin
    notices and applies the fleet's to ``spot``. ``clock``: monotonic seconds (the clock of
    ``spot``)."""

    def __init__(
        self,
        cfg: GatewayConfig,
        link: RedisLink,
        spot: SpotNotices,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.spot = spot
        self.clock = clock
        self.keep_s = max(10 * cfg.spot.half_life_s, cfg.lifecycle.preempt_hold_s)
        self.key = link.key("ops", "notices")
        self._submit = link.client.register_script(SUBMIT)
        self._applied: dict[str, float] = {}  # notice id -> its store time (pruned by age)

    async def submit(self, notice: SpotNotice) -> tuple[NoticeRecord, NoticeOutcome]:
        """Write ``notice`` (its ``zone`` set) for the fleet, then apply it here (count and
        score; the caller preempts through the op records). Raises
        :class:`CoordinationUnavailable` (nothing written, nothing applied)."""
        args = [
            secrets.token_hex(8), notice.zone or "", notice.node or "",
            notice.instance_type or "", self.link.replica_id, notice.reason,
            repr(float(self.keep_s)),
        ]
        raw = await self.link.call(
            "spot_notice", lambda c: self._submit([self.key], args, client=c)
        )
        rec = NoticeRecord.parse(str(raw))
        if rec is None:  # cannot happen with SUBMIT's output; refuse rather than guess
            raise CoordinationUnavailable(f"the store returned an unreadable notice: {raw}")
        return rec, self._apply(rec)

    async def sync(self) -> None:
        """Apply every notice record not applied here yet, oldest first (one ``HGETALL``).
        Raises :class:`CoordinationUnavailable`."""
        raw: dict[Any, Any] = await self.link.call(
            "spot_notices_sync", lambda c: c.hgetall(self.key)
        )
        recs = [r for r in (NoticeRecord.parse(str(v)) for v in raw.values()) if r is not None]
        for rec in sorted(recs, key=lambda r: r.at):
            if rec.id not in self._applied:
                out = self._apply(rec)
                if rec.by != self.link.replica_id and not out.repeat:
                    log.info("spot notice for zone %s (node %s) from replica %s applied",
                             rec.zone, rec.node or "-", rec.by)
        oldest = self.link.now() - self.keep_s
        self._applied = {i: at for i, at in self._applied.items() if at >= oldest}

    def _apply(self, rec: NoticeRecord) -> NoticeOutcome:
        """Count ``rec`` and drop its zone's score here, as of its store time."""
        self._applied[rec.id] = rec.at
        at = self.link.to_local(rec.at, self.clock())
        return self.spot.notice(rec.notice, preempt=False, at=at)
