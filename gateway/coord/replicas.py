"""Which replicas of the fleet are alive: each one's heartbeat in the shared store.

Every sync round a replica runs one script (:data:`HEARTBEAT`): it stamps its own entry in the
sorted set ``<ns>:replicas`` with the store's clock (milliseconds), drops the entries older
than ``coordination.replica_ttl_s``, and reads the ones left. Its description (host, pid,
start time, listening address) sits in the hash ``<ns>:replica_info``. The store's clock is
the only one used, so hosts whose clocks disagree still agree on who is alive.

A replica id belongs to one process at a time: each process stamps a random ``instance`` token
in its description, and the script refuses to stamp an id whose entry is still alive under
another instance (two replicas given the same ``coordination.replica_id``, e.g. one config
copied to two hosts). The later one then runs on its local share, as if the store did not
answer (no lease, no shared quota under a name it would share with the other), and says why
in ``/ready``, ``/admin/fleet`` and its log, until the id is free again: at once after the
other stops gracefully, at most ``coordination.replica_ttl_s`` after it died.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from gateway.coord.link import RedisLink
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

# KEYS: replicas zset, info hash. ARGV: replica id, ttl ms, info JSON, instance token.
# Returns {the live replicas and their last heartbeat (ms of the store's clock), flat; the
# info hash, flat}; or {TAKEN, the other's info JSON} when the id is alive under another
# instance.
TAKEN = "!taken"
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
if seen and tonumber(seen) > now - tonumber(ARGV[2]) then
  local prev = redis.call('HGET', KEYS[2], ARGV[1])
  if prev then
    local ok, p = pcall(cjson.decode, prev)
    if ok and type(p) == 'table' and p.instance and p.instance ~= ARGV[4] then
      return {'!taken', prev}
    end
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
  redis.call('HDEL', KEYS[2], unpack(gone))
end
return {redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[2])}
"""


LIVE_ENTRIES = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local live = {}
for i = 3, #ARGV do live[ARGV[i]] = true end
live[ARGV[1]] = true
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for j = 1, #all, 2 do
  if live[all[j]] then
    table.insert(out, all[j]); table.insert(out, all[j + 1])
  else
    redis.call('HDEL', KEYS[1], all[j])
  end
end
"""
"""The start of a script over a hash of per-replica entries (``KEYS[1]``; ARGV: this
replica's id, its entry, then the live replica ids): writes this replica's entry, drops
the entries of replicas not alive and leaves the live ones flat in ``out``; the script
that uses it ends with its own ``return`` (``coord/capacity.py``, ``coord/autoscale.py``)."""

def config_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What two replicas' descriptions disagree on about the fleet they share (``backends``:
    id -> URL, ``max_unavailable``), said for an operator; None when they agree or when
    ``theirs`` does not say (an older replica). Replicas of one namespace share drains,
    leases and verdicts by backend id, so the same id must be the same server everywhere."""
    if "backends" not in theirs:
        return None
    a: dict[str, str] = mine.get("backends") or {}
    b: dict[str, str] = theirs.get("backends") or {}
    out = [f"{i}: {a[i]} here, {b[i]} there" for i in sorted(a.keys() & b.keys()) if a[i] != b[i]]
    if a.keys() - b.keys():
        out.append(f"only here: {', '.join(sorted(a.keys() - b.keys()))}")
    if b.keys() - a.keys():
        out.append(f"only there: {', '.join(sorted(b.keys() - a.keys()))}")
    if mine.get("max_unavailable") != theirs.get("max_unavailable"):
        out.append(
            f"lifecycle.max_unavailable {mine.get('max_unavailable')} here, "
            f"{theirs.get('max_unavailable')} there"
        )
    return "; ".join(out) or None


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One live replica: its id, last heartbeat (unix seconds, the store's clock) and what it
    said about itself (host, pid, started, listen)."""

    id: str
    seen_at: float
    info: dict[str, Any]


class Replicas:
    """The live replicas as last read (:meth:`heartbeat`); ``alive`` counts this one even
    before the first read (a lone replica is always 1)."""

    def __init__(
        self,
        link: RedisLink,
        metrics: GatewayMetrics,
        listen: str = "",
        fleet: dict[str, Any] | None = None,
    ) -> None:
        self.link = link
        self.metrics = metrics
        self.info: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "listen": listen,
            "instance": secrets.token_hex(8),  # whose this id is (see the module's doc)
            **(fleet or {}),  # backends (id -> URL), max_unavailable: see config_differences
        }
        self.live: list[ReplicaInfo] = []
        # replica id -> what its config disagrees on with this one's (config_differences)
        self.differences: dict[str, str] = {}
        self._logged: dict[str, str] = {}  # replica id -> the difference last logged
        self._script = link.client.register_script(HEARTBEAT)

    @property
    def alive(self) -> int:
        """Replicas alive now (at least 1: this one)."""
        return max(1, len(self.live))

    def ids(self) -> list[str]:
        """Ids of the live replicas, this one included, sorted."""
        out = {r.id for r in self.live}
        out.add(self.link.replica_id)
        return sorted(out)

    async def heartbeat(self) -> None:
        """Stamp this replica alive and read the others (one script call). Raises
        :class:`gateway.coord.link.CoordinationUnavailable` when the store does not answer
        (the last list read is kept), or when another live process holds this replica's id
        (the link is then down with that reason: see the module's doc)."""
        ns_ttl_ms = int(self.link.cfg.replica_ttl_s * 1000)
        keys = [self.link.key("replicas"), self.link.key("replica_info")]
        args: list[str | int] = [
            self.link.replica_id, ns_ttl_ms, json.dumps(self.info), str(self.info["instance"])
        ]
        reply = await self.link.call("heartbeat", lambda c: self._script(keys, args, client=c))
        if reply and reply[0] == TAKEN:
            self.link.refuse("heartbeat", self._taken_reason(str(reply[1])))
        pairs, info_flat = reply
        infos = {str(info_flat[i]): info_flat[i + 1] for i in range(0, len(info_flat), 2)}
        live: list[ReplicaInfo] = []
        for i in range(0, len(pairs), 2):
            rid, score = str(pairs[i]), float(pairs[i + 1])
            raw = infos.get(rid)
            try:
                info = json.loads(raw) if raw else {}
            except ValueError:
                info = {}
            live.append(ReplicaInfo(rid, score / 1000.0, info))
        self.live = live
        self.metrics.replicas_alive.set(len(live))
        self._compare(live)

    def _compare(self, live: list[ReplicaInfo]) -> None:
        """Note (and log once per replica and difference) the live replicas whose config
        disagrees with this one's about the shared fleet: same namespace, other backends
        (e.g. two unrelated fleets on one Redis without their own ``namespace``). Not logged
        while a live reload is on its way (:mod:`gateway.coord.config_sync`: the two run
        different config versions and neither refused the fleet's): shown only."""
        found: dict[str, str] = {}
        for r in live:
            if r.id == self.link.replica_id:
                continue
            diff = config_differences(self.info, r.info)
            if diff is None:
                continue
            found[r.id] = diff
            reloading = (r.info.get("config_version") != self.info.get("config_version")
                         and not r.info.get("config_refused")
                         and not self.info.get("config_refused"))
            if self._logged.get(r.id) != diff and not reloading:
                self._logged[r.id] = diff
                log.warning(
                    "replica %s shares namespace %r but its config differs from this one's "
                    "(%s): replicas of one namespace share drains, leases and verdicts by "
                    "backend id; give unrelated fleets their own coordination.namespace",
                    r.id, self.link.cfg.namespace, diff,
                )
        self.differences = found
        self._logged = {k: v for k, v in self._logged.items() if k in found}

    def _taken_reason(self, other_json: str) -> str:
        """Why this replica cannot use its id: who holds it, and what to change."""
        try:
            other = json.loads(other_json)
        except ValueError:
            other = {}
        who = ", ".join(
            f"{k} {other[k]}" for k in ("host", "pid", "listen") if other.get(k) not in (None, "")
        )
        return (
            f"replica id {self.link.replica_id!r} is in use by another live replica"
            f"{f' ({who})' if who else ''}: give each replica its own "
            "coordination.replica_id (or leave it unset); running on the local share until "
            f"the id is free (at most coordination.replica_ttl_s, {self.link.cfg.replica_ttl_s:g}"
            " s, after the other stops)"
        )

    async def leave(self) -> None:
        """Take this replica out of the list at once (a graceful stop); best effort."""
        rid = self.link.replica_id

        async def remove(c: Any) -> None:
            await c.zrem(self.link.key("replicas"), rid)
            await c.hdel(self.link.key("replica_info"), rid)

        try:
            await self.link.call("leave", remove)
        except Exception:
            pass
