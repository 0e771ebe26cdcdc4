"""The replica's link to the shared store (Redis or Valkey, through redis-py's asyncio client).

Every call goes through :meth:`RedisLink.call`, which bounds it (``coordination.op_timeout_s``:
the socket timeout, with :func:`asyncio.wait_for` as a backstop), counts a failure in
``gateway_coordination_errors_total{op}`` and turns it into :class:`CoordinationUnavailable`.
After a failure the link is *down*: calls fail at once, without touching the network, until
:meth:`RedisLink.probe` (run every ``coordination.retry_interval_s`` by the ``coordination``
loop) gets a ``PING`` answered; then the link is *up* again and the resync callbacks run
(each part writes back what it holds, since a restarted Redis may have lost everything). So a
dead store costs a request nothing but a flag check, and a slow one at most ``op_timeout_s``
once per retry interval.

Times in the store are the store's own clock (``TIME`` inside scripts, or :meth:`RedisLink.now`,
the local wall clock corrected by the offset measured at each probe), so replicas on hosts
whose clocks disagree still agree about leases and deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.config import CoordinationConfig
from gateway.core.urls import redacted_url
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

T = TypeVar("T")
Resync = Callable[[], Awaitable[None]]


class CoordinationUnavailable(Exception):
    """The shared store did not answer: down, slower than ``coordination.op_timeout_s``, or
    the link is waiting for its next retry. ``str(exc)`` says which, for operators."""


def default_replica_id() -> str:
    """``<hostname>-<pid>-<4 hex>``: unique per process, readable in ``/admin/fleet``."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class RedisLink:
    """One replica's connection to the store at ``cfg.redis_url``.

    ``replica_id``: this replica's name in the store. ``clock``: monotonic seconds (retry
    pacing); ``wall``: unix seconds. ``client``: an existing redis-py asyncio client (tests);
    default: one built from the URL with ``op_timeout_s`` socket timeouts and one retry on a
    fresh connection when a pooled one was closed (the link paces every other retry).
    """

    def __init__(
        self,
        cfg: CoordinationConfig,
        metrics: GatewayMetrics,
        replica_id: str,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not cfg.redis_url:
            raise ValueError("RedisLink needs coordination.redis_url")
        self.cfg = cfg
        self.metrics = metrics
        self.replica_id = replica_id
        self.clock = clock
        self.wall = wall
        self.client: aioredis.Redis = client or aioredis.Redis.from_url(
            cfg.redis_url,
            socket_timeout=cfg.op_timeout_s,
            socket_connect_timeout=cfg.op_timeout_s,
            retry_on_timeout=False,
            # a pooled connection the store closed (it restarted) is tried once more on a
            # fresh one; anything else fails at once (the link paces its own retries)
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
            decode_responses=True,
            health_check_interval=0,
        )
        self.up = False  # until the first probe answers
        self.answered_once = False  # the store has answered a probe since start
        self.reason = "not connected yet"
        self.down_since: float | None = clock()  # monotonic; None while up
        self.offset_s = 0.0  # store clock - local wall clock (seconds)
        self._next_try = 0.0
        self._resync: list[Resync] = []
        self._refused = ""  # the last refusal logged (refuse() logs each reason once)
        metrics.coord_up.set(0)
        metrics.coord_fallback.set(1)

    def key(self, *parts: str) -> str:
        """The store key ``<namespace>:<part>:<part>...`` (every key of this fleet)."""
        return ":".join((self.cfg.namespace, *parts))

    def now(self) -> float:
        """The store's clock, in unix seconds, as best known here (local wall clock plus the
        offset measured at the last probe)."""
        return self.wall() + self.offset_s

    def to_local(self, store_s: float, local_now: float) -> float:
        """Store-clock time ``store_s`` (unix seconds) on a local clock whose reading now is
        ``local_now`` (e.g. monotonic seconds): ``local_now + (store_s - now())``."""
        return local_now + (store_s - self.now())

    def on_resync(self, callback: Resync) -> None:
        """Run ``callback`` each time the store answers again after being down (and at the
        first connection): the part writes back what it holds."""
        self._resync.append(callback)

    @property
    def fallback(self) -> bool:
        """Whether this replica runs on its local share now (the store does not answer)."""
        return not self.up

    def down_for_s(self) -> float:
        """Seconds since the store stopped answering (0 while up)."""
        return 0.0 if self.down_since is None else self.clock() - self.down_since

    async def call(self, op: str, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """Run ``fn(client)`` against the store, bounded by ``op_timeout_s``. ``op`` names it
        in the error metric. Raises :class:`CoordinationUnavailable` when the link is down
        (at once) or the call fails or times out (then the link goes down)."""
        if not self.up:
            raise CoordinationUnavailable(self.reason)
        try:
            return await asyncio.wait_for(fn(self.client), self.cfg.op_timeout_s * 2)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(op, exc)
            raise CoordinationUnavailable(self.reason) from exc

    def refuse(self, op: str, reason: str) -> None:
        """The store answered but this replica must not use it now (``reason``, for
        operators: e.g. its replica id is taken): the link goes down as for a failed call
        (local share, admin writes refused with ``reason``), probed again every
        ``retry_interval_s``. Raises :class:`CoordinationUnavailable`."""
        self.metrics.coord_errors.labels(op).inc()
        if reason != self._refused:  # once, not at every retry
            log.error("shared store %s: %s", redacted_url(self.cfg.redis_url or ""), reason)
            self._refused = reason
        self._go_down(reason)
        raise CoordinationUnavailable(reason)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.metrics.coord_errors.labels(op).inc()
        detail = (str(exc) or type(exc).__name__).rstrip(".")
        if isinstance(exc, TimeoutError):
            detail = f"no answer within {self.cfg.op_timeout_s * 2:g} s"
        if self.up:
            log.warning(
                "shared store %s stopped answering (%s: %s); running on the local share",
                redacted_url(self.cfg.redis_url or ""), op, detail,
            )
        self._go_down(f"the shared store (Redis) does not answer: {op}: {detail}")

    def _go_down(self, reason: str) -> None:
        if self.down_since is None:
            self.down_since = self.clock()
        self.up = False
        self.reason = reason
        self._next_try = self.clock() + self.cfg.retry_interval_s
        self.metrics.coord_up.set(0)
        self.metrics.coord_fallback.set(1)

    async def probe(self) -> bool:
        """While down: once ``retry_interval_s`` has passed since the last try, ``PING`` the
        store (and read its clock); when it answers, the link is up and every resync callback
        runs (a failing one counts as a failed call and takes the link down again). While
        up: read the store's clock (keeps the offset fresh). Returns whether the link is up.
        Never raises for a store failure."""
        if not self.up and self.clock() < self._next_try:
            return False
        try:
            t0 = self.wall()
            sec, usec = await asyncio.wait_for(self.client.time(), self.cfg.op_timeout_s * 2)
            t1 = self.wall()
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed("probe", exc)
            return False
        self.offset_s = (float(sec) + float(usec) / 1e6) - (t0 + t1) / 2
        self.answered_once = True
        if self.up:
            return True
        was_down = self.down_since is not None and self.reason != "not connected yet"
        # up and its reason change together: no reader sees the link up with a down reason
        # (a failing resync below takes it down again with its own reason)
        self.up = True
        self.reason = ""
        down_s = self.down_for_s()
        self.metrics.coord_up.set(1)
        self.metrics.coord_fallback.set(0)
        for cb in list(self._resync):
            try:
                await cb()
            except CoordinationUnavailable:
                return False  # down again: down_since kept
            except Exception:  # a part's bug must not keep the others from resyncing
                log.exception("resync callback failed")
        self.down_since = None
        self._refused = ""
        if was_down:
            self.metrics.coord_resyncs.inc()
            log.warning(
                "shared store %s answers again after %.1f s; state written back",
                redacted_url(self.cfg.redis_url or ""), down_s,
            )
        else:
            log.info(
                "shared store %s connected (replica %s)",
                redacted_url(self.cfg.redis_url or ""), self.replica_id,
            )
        return self.up

    async def close(self) -> None:
        """Close the client's connections (the store's own TTLs end what this replica held)."""
        try:
            await self.client.aclose()
        except (RedisError, OSError):
            pass
