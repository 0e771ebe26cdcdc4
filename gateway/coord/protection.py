"""Backend protection shared by the fleet: a backend's 429/503 cooling and a breaker trip
seen by one replica make every replica back off it (issue 14, item 4).

Nothing here runs on the request path: the pipeline cools its local ``Backend``
(``Backend.cool_until``) and the lease moves its local breaker as before; this part's sync
step (every ``coordination.sync_interval_s``) reads those and publishes what is new, and
applies what the other replicas published, in one script call (:data:`SYNC`).

Keys (under the fleet's namespace, prefix ``protect``):

- ``protect:cool``, a hash: backend id -> cooling end (unix seconds, the store's clock). Only
  raised (the script keeps the later end); ends older than a minute are dropped.
- ``protect:breaker:<backend>``, a string ``<owner>|<state>|<open_until>`` with a TTL: the
  replica that tripped the backend's breaker (the *owner*), ``open`` with the end of its
  open time (store clock), or ``closed`` (its half-open probe succeeded). The owner renews it
  every round while its breaker is open or half-open, with a TTL of the open time left plus
  ``coordination.breaker_hold_s``; a replica that trips a breaker whose record names another
  owner does not take it over.

What each replica does with them: a cooling end later than its own cools its ``Backend``
until then (converted to its monotonic clock: ``clock() + (end - store_now)``). A breaker
record of another owner holds the local breaker open (``CircuitBreaker.hold_open_until``)
until the record's TTL ends, renewed every round: so only the owner probes half-open, one
probe per half-open period fleet-wide, not one per replica. ``closed`` releases the hold
(``release_hold``). A record that expires (its owner died or lost the store) lets the hold
end by itself: the usual local half-open follows.

Visibility: a trip or cooling is published at the owner's next round and applied at the
others' next round: within ``2 x sync_interval_s`` plus two round trips (0.5 s at the
defaults). Store down: nothing is published or read; holds end by themselves, coolings
already applied stay, each replica protects itself as in the one-process gateway. Resync
(the store answers again, maybe empty after a restart): every cooling still running here
and every record this replica owns is written again at the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gateway.coord.link import RedisLink
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.traffic.breaker import BreakerState

log = logging.getLogger("gateway.coord")

# KEYS[1]: the cooling hash; KEYS[2..]: the breaker record of each backend (fleet order).
# ARGV[1]: this replica's id; ARGV[2]: n coolings, then n x (backend id, end);
# then m breaker writes, m x (key index, state, open_until, ttl ms); a write is done only
# when the key is absent, names this replica or says ``closed`` (another owner's open
# record is left alone).
# Returns {store now (s), flat HGETALL of the coolings, then per breaker key: value or "",
# PTTL (ms)}.
SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local me = ARGV[1]
local i = 2
local nc = tonumber(ARGV[i]); i = i + 1
for _ = 1, nc do
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > old then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
  i = i + 2
end
local nb = tonumber(ARGV[i]); i = i + 1
for _ = 1, nb do
  local k = KEYS[tonumber(ARGV[i])]
  local cur = redis.call('GET', k)
  if (not cur) or string.sub(cur, 1, #me + 1) == me .. '|'
      or string.find(cur, '|closed|', 1, true) then
    redis.call('SET', k, me .. '|' .. ARGV[i + 1] .. '|' .. ARGV[i + 2], 'PX', ARGV[i + 3])
  end
  i = i + 4
end
local cool = redis.call('HGETALL', KEYS[1])
for j = 1, #cool, 2 do
  if tonumber(cool[j + 1]) < now - 60 then redis.call('HDEL', KEYS[1], cool[j]) end
end
local out = {tostring(now), cool}
for j = 2, #KEYS do
  table.insert(out, redis.call('GET', KEYS[j]) or '')
  table.insert(out, redis.call('PTTL', KEYS[j]))
end
return out
"""

OPEN = "open"
CLOSED = "closed"
# how long a ``closed`` record stays for the others to read (seconds, x sync_interval_s)
_CLOSED_ROUNDS = 8


class SharedProtection:
    """Publishes this replica's coolings and breaker trips, applies the others'.
    ``clock``: monotonic seconds (the backends' clock)."""

    def __init__(
        self,
        link: RedisLink,
        fleet: Fleet,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.link = link
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        self._script = link.client.register_script(SYNC)
        self._applied_cool: dict[str, float] = {}  # backend id -> cooling end applied (mono)
        self._published_cool: dict[str, float] = {}  # backend id -> local end published
        self._owned: dict[str, float] = {}  # backend id -> open_until (mono) published as owner
        self._closing: dict[str, int] = {}  # backend id -> rounds left to publish ``closed``

    async def resync(self) -> None:
        """The store answers again (maybe empty): write everything again next round."""
        self._published_cool.clear()
        self._owned.clear()

    # ---- one round ------------------------------------------------------------------------
    async def sync(self) -> None:
        """Publish what is new here, then apply what the store holds (one script call).
        Raises :class:`gateway.coord.link.CoordinationUnavailable` when the store does not
        answer (nothing applied; holds end by themselves)."""
        backends = self.fleet.backends
        me = self.link.replica_id
        now = self.clock()
        store_now = self.link.now()
        args: list[str | int | float] = [me]
        cools: list[str | float] = []
        sent: dict[str, float] = {}  # backend id -> the local cooling end published
        for b in backends:
            end = b.cooling_until
            if (
                end > now
                and end > self._applied_cool.get(b.id, 0.0) + 1e-3
                and self._published_cool.get(b.id) != end
            ):
                cools += [b.id, f"{store_now + (end - now):.3f}"]
                sent[b.id] = end
        args += [len(cools) // 2, *cools]
        writes: list[str | int | float] = []
        owned_now: dict[str, float] = {}
        hold_ms = self.link.cfg.breaker_hold_s * 1000
        for i, b in enumerate(backends):
            br = b.breaker
            state = br.current()
            if state is not BreakerState.CLOSED and not br.held:
                left = max(0.0, br.open_until - now)
                owned_now[b.id] = br.open_until
                self._closing.pop(b.id, None)
                writes += [i + 2, OPEN, f"{store_now + left:.3f}", int(left * 1000 + hold_ms)]
            elif b.id in self._owned or b.id in self._closing:
                # our trip ended closed: tell the others for a few rounds (then it expires)
                rounds = self._closing.get(b.id, _CLOSED_ROUNDS)
                if rounds > 0:
                    ttl = int(self.link.cfg.sync_interval_s * _CLOSED_ROUNDS * 1000 + hold_ms)
                    writes += [i + 2, CLOSED, f"{store_now:.3f}", ttl]
                    self._closing[b.id] = rounds - 1
                else:
                    self._closing.pop(b.id, None)
        args += [len(writes) // 4, *writes]
        keys = [self.link.key("protect", "cool")] + [
            self.link.key("protect", "breaker", b.id) for b in backends
        ]
        out: list[Any] = await self.link.call(
            "protection", lambda c: self._script(keys, args, client=c)
        )
        self._published_cool.update(sent)
        self._owned = owned_now
        self._apply(out, backends)

    def _apply(self, out: list[Any], backends: list[Backend]) -> None:
        store_now = float(out[0])
        now = self.clock()
        flat = out[1]
        for k in range(0, len(flat), 2):
            cooled = self.fleet.get(str(flat[k]))
            end = float(flat[k + 1])
            if cooled is None or end <= store_now:
                continue
            local = now + (end - store_now)
            if local > cooled.cooling_until + 1e-3:
                cooled.cool_until(local)
                self._applied_cool[cooled.id] = local
                self.metrics.protection_applied.labels(cooled.id, "cooling").inc()
                log.info("backend %s: cooling for %.1f s (another replica's Retry-After)",
                         cooled.id, end - store_now)
        me = self.link.replica_id
        for i, b in enumerate(backends):
            raw, pttl = str(out[2 + 2 * i] or ""), int(out[3 + 2 * i])
            if not raw:
                continue
            owner, state, _ = raw.split("|", 2)
            if owner == me:
                continue
            br = b.breaker
            if state == OPEN and pttl > 0:
                was_held = br.held and br.current() is BreakerState.OPEN
                br.hold_open_until(now + pttl / 1000.0)
                if not was_held:
                    self.metrics.protection_applied.labels(b.id, "breaker_hold").inc()
                    log.info("backend %s: breaker held open (tripped by replica %s)", b.id, owner)
            elif state == CLOSED and br.held and br.current() is BreakerState.OPEN:
                br.release_hold()
                log.info("backend %s: breaker closed (replica %s's probe passed)", b.id, owner)
