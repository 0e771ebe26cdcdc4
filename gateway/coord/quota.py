"""Global rate limits over the shared store: the I/O side of :mod:`gateway.traffic.quota`.

Each limit of each client key is one token bucket in the store, the hash
``<ns>:rl:<key name>:<req|tok>`` with its ``level`` and the store time it was at (``at``,
unix seconds of ``TIME``); a missing hash is a full bucket (a new key, or one whose bucket
refilled: the hash expires once it would be full). One script (:data:`QUOTA`) refills a
bucket from the store's ``TIME`` at ``limit / 60`` per second up to the burst ``limit`` and
then either *takes* (a fetch: up to ``ask``, none unless ``need`` is there) or *moves* a
delta (positive: unspent quota given back, never above the burst; negative: a debt or the
local share's use charged, never below ``-limit``). Several buckets go in one call.

:class:`GlobalQuotas` is this replica's side, the
:class:`~gateway.traffic.quota.QuotaSource` of every
:class:`~gateway.traffic.quota.GlobalKeyLimiter`:

* a **fetch** is a background task (kept in a set, cancelled at stop), one per bucket at a
  time, started by the request path without waiting (:meth:`GlobalQuotas.refill`); a
  request whose balance is empty may wait for it (:meth:`GlobalQuotas.wait`, bounded by
  ``coordination.quota_wait_s``; at once when the store is down);
* the **sync step** (every ``coordination.sync_interval_s``) moves what the buckets hand
  over (:meth:`~gateway.traffic.quota.QuotaBucket.sync_delta`: idle balances and
  surpluses back, debts charged), all in one script call;
* **resync** (the store answers again): every bucket leaves the local share and what it
  used there is charged to the global bucket at once (a restarted Redis lost the buckets:
  they start full, less what the replicas write back);
* **stop**: unspent balances go back (best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.config import CoordinationConfig
from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.coord.replicas import Replicas
from gateway.metrics import GatewayMetrics
from gateway.traffic.quota import GlobalKeyLimiter, QuotaBucket

# KEYS: bucket hashes. ARGV: 5 per key: rate (per second), burst, amount, need, op
# ("take": up to amount if at least need is there; "move": add amount, may be negative).
# Returns, per key, what was taken or moved and the level after (strings: Lua numbers would
# be truncated to integers), then the store's time (unix seconds).
QUOTA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i, key in ipairs(KEYS) do
  local a = (i - 1) * 5
  local rate, cap = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local amount, need, op = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5]
  local level = cap
  local h = redis.call('HMGET', key, 'level', 'at')
  if h[1] then
    level = math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
  end
  local moved = 0
  if op == 'take' then
    if level >= need then
      moved = math.min(amount, math.floor(level))
      level = level - moved
    end
  else
    local after = math.max(-cap, math.min(cap, level + amount))
    moved = after - level
    level = after
  end
  if level >= cap then
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 'level', tostring(level), 'at', tostring(now))
    redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000) + 1000)
  end
  table.insert(out, tostring(moved))
  table.insert(out, tostring(level))
end
table.insert(out, tostring(now))
return out
"""


class GlobalQuotas:
    """This replica's side of the global rate limits (see the module docstring): the
    :class:`~gateway.traffic.quota.QuotaSource` handed to the entry layer by
    :func:`gateway.wiring.build_gateway`. ``clock``: local monotonic seconds."""

    def __init__(
        self,
        link: RedisLink,
        replicas: Replicas,
        metrics: GatewayMetrics,
        cfg: CoordinationConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.replicas = replicas
        self.metrics = metrics
        self.cfg = cfg
        self.clock = clock
        self.limiters: dict[str, GlobalKeyLimiter] = {}  # key name -> its limits, tracked
        self.fetches: dict[QuotaBucket, asyncio.Task[None]] = {}  # the one running per bucket
        self.tasks: set[asyncio.Task[None]] = set()
        self._script = link.client.register_script(QUOTA)

    # ---- QuotaSource -------------------------------------------------------------------------
    @property
    def fallback(self) -> bool:
        """True while the store does not answer (limits on the local share)."""
        return not self.link.up

    @property
    def alive(self) -> int:
        """Replicas alive as last seen (at least 1)."""
        return self.replicas.alive

    def track(self, limiter: GlobalKeyLimiter) -> None:
        """Sync ``limiter`` from now on (the entry layer made it)."""
        self.limiters[limiter.name] = limiter

    def forget(self, limiter: GlobalKeyLimiter) -> None:
        """Stop syncing ``limiter`` (dropped by the entry layer: it held nothing)."""
        if self.limiters.get(limiter.name) is limiter:
            del self.limiters[limiter.name]

    def refill(self, limiter: GlobalKeyLimiter, bucket: QuotaBucket, ask: int, need: int) -> None:
        """Start one fetch for ``bucket`` in the background (no wait here)."""
        task = asyncio.get_running_loop().create_task(self._fetch(limiter, bucket, ask, need))
        self.fetches[bucket] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self, limiter: GlobalKeyLimiter, timeout_s: float) -> bool:
        """Wait for the running fetches of ``limiter``'s buckets, at most ``timeout_s``
        (none when the store is down: they fail at once). Returns whether they landed.

        A key's first fetch on this replica (a bucket the store has not told it about yet)
        is waited for as long as the store call itself may take (``op_timeout_s``): a
        key's first request is never refused because the store took more than
        ``quota_wait_s`` to answer once."""
        buckets = [b for b in limiter.buckets() if b in self.fetches]
        running = [self.fetches[b] for b in buckets]
        if not running:
            return True
        if not all(b.heard for b in buckets):
            timeout_s = max(timeout_s, self.link.cfg.op_timeout_s)
        _done, pending = await asyncio.wait(running, timeout=timeout_s)
        landed = not pending
        self.metrics.quota_waits.labels("landed" if landed else "timed_out").inc()
        return landed

    # ---- the store -----------------------------------------------------------------------------
    def _key(self, limiter: GlobalKeyLimiter, bucket: QuotaBucket) -> str:
        return self.link.key("rl", limiter.name, bucket.kind)

    def _local(self, store_t: float) -> float:
        """Store time (unix seconds) as local monotonic seconds."""
        return self.link.to_local(store_t, self.clock())

    async def _run(
        self, op: str, items: Sequence[tuple[GlobalKeyLimiter, QuotaBucket, float, int, str]]
    ) -> tuple[list[tuple[float, float]], float]:
        """One script call over ``items`` (limiter, bucket, amount, need, op): per item what
        moved and the level after, and the local monotonic time of the store's reading."""
        keys = [self._key(lim, b) for lim, b, _a, _n, _o in items]
        args: list[Any] = []
        for _lim, b, amount, need, what in items:
            args += [repr(b.rate), b.limit, repr(float(amount)), need, what]
        flat = await self.link.call(op, lambda c: self._script(keys, args, client=c))
        at = self._local(float(flat[-1]))
        pairs = [(float(flat[i]), float(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]
        return pairs, at

    async def _fetch(
        self, limiter: GlobalKeyLimiter, bucket: QuotaBucket, ask: int, need: int
    ) -> None:
        try:
            item = (limiter, bucket, float(ask), need, "take")
            [(got, level)], at = await self._run("quota_fetch", [item])
        except CoordinationUnavailable:
            bucket.fetch_failed()
            self.metrics.quota_fetches.labels(bucket.kind, "failed").inc()
            return
        except BaseException:
            bucket.fetch_failed()
            raise
        finally:
            if self.fetches.get(bucket) is asyncio.current_task():
                del self.fetches[bucket]
        bucket.granted(got, level, at)
        result = "full" if got >= ask else "partial" if got > 0 else "none"
        self.metrics.quota_fetches.labels(bucket.kind, result).inc()

    async def _move(
        self, op: str, moves: list[tuple[GlobalKeyLimiter, QuotaBucket, float]]
    ) -> None:
        """Move each ``(limiter, bucket, delta)`` to the global buckets in one call; on a
        failure every delta is kept by its bucket for later (and the error raised)."""
        if not moves:
            return
        try:
            pairs, at = await self._run(op, [(lim, b, d, 0, "move") for lim, b, d in moves])
        except CoordinationUnavailable:
            for _lim, b, d in moves:
                b.restore(d)
            raise
        for (_lim, b, d), (_moved, level) in zip(moves, pairs, strict=True):
            b.seen(level, at)
            if d > 0:
                self.metrics.quota_returned.labels(b.kind).inc(d)

    def _deltas(self, idle_s: float) -> list[tuple[GlobalKeyLimiter, QuotaBucket, float]]:
        now = self.clock()
        out = []
        for lim in self.limiters.values():
            for b in lim.buckets():
                d = b.sync_delta(now, idle_s)
                if d != 0.0:
                    out.append((lim, b, d))
        return out

    # ---- the coordination loop's parts ------------------------------------------------------
    async def sync(self) -> None:
        """The sync step: idle balances and surpluses back, debts charged (one call)."""
        await self._move("quota_sync", self._deltas(self.cfg.quota_idle_s))

    async def resync(self) -> None:
        """The store answers again: every bucket leaves the local share, and what it used
        there (beyond the balance it had) is charged to the global bucket now."""
        now = self.clock()
        for lim in self.limiters.values():
            for b in lim.buckets():
                b.leave_share(now)
        await self._move("quota_resync", self._deltas(self.cfg.quota_idle_s))

    async def stop(self) -> None:
        """Cancel the fetches, then give every unspent balance back (best effort)."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(CoordinationUnavailable):
            await self._move("quota_stop", self._deltas(0.0))
