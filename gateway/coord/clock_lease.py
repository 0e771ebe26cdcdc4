"""Fleet mode: one replica drives the GPUs' clock caps and power limits (issue 21).

With several gateway replicas, each runs the GPU telemetry loop; if each also drove the
agents, they would fight over every cap. So the caps are driven under one lease:

* ``<ns>:clocks:lease``, a string (the holder's replica id) with a TTL of
  ``coordination.lease_ttl_s`` (10 s), renewed by the holder at every sync round
  (``coordination.sync_interval_s``) and taken by any replica with ``thermal.clocks`` on
  (:class:`gateway.fleet.clock_driver.ClockDriver` built) once it has expired;
* ``<ns>:clocks:state``, a string (JSON ``{"by", "backends": {id: entry}}``, the holder's
  :meth:`ClockDriver.snapshot`), written by the holder at every sync round with the same
  TTL: the other replicas read it for power shedding (both levers spent?), thermal
  cooldowns (clocks at their floor?) and ``/admin/backends``.

Both are one script (:data:`SYNC`): renew or take the lease and publish, or read the
holder's state. The holder drives only while its lease was confirmed within the TTL
(counted from before the call that confirmed it, so it stops before the store lets anyone
else take it). The others touch no agent: the holder's rounds are the agents' only contact,
so when the holder dies the lease lapses within the TTL, another replica takes it at its next
sync round and calls the agents at its next GPU round (``thermal.scrape_interval_s``): at
most TTL + one sync round + one GPU round after the death, about 12 s with the defaults
(10 + 0.25 + 2; well inside the agents' 60-s revert), adopts the caps the agents report
and moves on from them; and when the store fails, no replica drives after the TTL, no
agent is contacted, and every agent reverts its GPUs 60 s after the last contact: no GPU
stays capped by accident. Meanwhile the replicas shed as without clocks (no fresh state:
nothing more can be lowered), and no request fails for the store. A replica that stops gives
the lease back (another takes over at once).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.fleet.clock_driver import ClockDriver, PeerState

log = logging.getLogger("gateway.coord")

# KEYS: lease, state. ARGV: replica id, ttl_ms, state JSON ('' : none to publish).
# Returns {1, ''} when this replica holds the lease (renewed or taken), else {0, holder,
# the holder's state or ''}.
SYNC = """
local h = redis.call('GET', KEYS[1])
if h == ARGV[1] or not h then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2]) end
  return {1, ''}
end
return {0, h, redis.call('GET', KEYS[2]) or ''}
"""

# KEYS: lease. ARGV: replica id. Gives the lease back when this replica holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ClockLease:
    """The clock lease of one replica over ``link`` for ``driver`` (module docstring);
    ``ttl_s``: the lease's TTL (seconds); ``clock``: monotonic seconds."""

    def __init__(
        self,
        link: RedisLink,
        driver: ClockDriver,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.driver = driver
        self.ttl_s = ttl_s
        self.clock = clock
        self.lease_key = link.key("clocks", "lease")
        self.state_key = link.key("clocks", "state")
        self.held_until = -1.0  # monotonic: drive until then
        self.holder: str | None = None  # last seen (this replica's id while it holds)
        self._peer: PeerState | None = None
        self._peer_until = -1.0
        driver.share(self.holds, self.peer)

    def holds(self) -> bool:
        """Whether this replica drives now: its lease was confirmed within the TTL."""
        return self.clock() < self.held_until

    def peer(self) -> PeerState | None:
        """The holder's published state while fresh (None: none, or older than the TTL)."""
        return self._peer if self.clock() < self._peer_until else None

    async def sync(self) -> None:
        """Renew or take the lease and publish this replica's state, or read the holder's.
        Raises :class:`CoordinationUnavailable` when the store does not answer (the lease
        then lapses here by time)."""
        me = self.link.replica_id
        started = self.clock()
        state = ""
        if self.holds():
            state = json.dumps({"by": me, "backends": self.driver.snapshot()})
        ttl_ms = int(self.ttl_s * 1000)
        raw = await self.link.call(
            "clocks_lease",
            lambda c: c.eval(SYNC, 2, self.lease_key, self.state_key, me, ttl_ms, state),
        )
        if int(raw[0]) == 1:
            if not self.holds():
                log.warning(
                    "replica %s drives the GPU clock caps and power limits now (lease %s%s)",
                    me,
                    self.lease_key,
                    "" if self.holder in (None, me) else f", taken over from {self.holder}",
                )
            self.held_until = started + self.ttl_s
            self.holder = me
            self._peer = None
            return
        if self.holds():
            log.warning("replica %s lost the GPU clock lease to %s", me, raw[1])
        self.held_until = -1.0
        self.holder = str(raw[1])
        self._peer = self._parse(str(raw[2]) if len(raw) > 2 else "")
        if self._peer is not None:
            self._peer_until = started + self.ttl_s

    @staticmethod
    def _parse(text: str) -> PeerState | None:
        if not text:
            return None
        try:
            data = json.loads(text)
            backends: Mapping[str, Mapping[str, Any]] = data["backends"]
        except (ValueError, KeyError, TypeError):
            return None
        return backends

    async def stop(self) -> None:
        """Give the lease back when held (best effort), so another replica takes over at
        its next sync round instead of after the TTL."""
        if not self.holds():
            return
        self.held_until = -1.0
        try:
            await self.link.call(
                "clocks_release",
                lambda c: c.eval(RELEASE, 1, self.lease_key, self.link.replica_id),
            )
        except CoordinationUnavailable:
            pass
