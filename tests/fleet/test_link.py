"""The link to the shared store against a real Redis: bounded calls, fail fast while down,
back by itself with the resync callbacks run; the replica list seen by every replica."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import GatewayConfig
from gateway.coord.coordination import Coordination
from gateway.coord.link import CoordinationUnavailable
from gateway.metrics import GatewayMetrics


def _cfg(url: str) -> GatewayConfig:
    return GatewayConfig(coordination={"redis_url": url, "op_timeout_s": 0.2,
                                       "retry_interval_s": 0.2, "replica_ttl_s": 1.0})


def test_replicas_see_each_other_and_a_stopped_one_leaves(redis_server):
    async def main() -> None:
        cfg = _cfg(redis_server.url)
        a, b = Coordination(cfg, GatewayMetrics(), "a"), Coordination(cfg, GatewayMetrics(), "b")
        await a.connect()
        await b.connect()
        await a.sync_round()
        assert a.replicas.ids() == ["a", "b"]
        assert a.metrics.replicas_alive._value.get() == 2
        await b.stop()  # leaves the list at once
        await a.sync_round()
        assert a.replicas.ids() == ["a"]
        await a.stop()

    asyncio.run(main())


def test_a_replica_that_stops_heartbeating_expires_after_the_ttl(redis_server):
    async def main() -> None:
        cfg = _cfg(redis_server.url)
        a, b = Coordination(cfg, GatewayMetrics(), "a"), Coordination(cfg, GatewayMetrics(), "b")
        await a.connect()
        await b.connect()  # then b goes silent without leaving (killed)
        await asyncio.sleep(1.2)
        await a.sync_round()
        assert a.replicas.ids() == ["a"]
        await a.stop()
        await b.link.close()

    asyncio.run(main())


def test_down_store_fails_fast_then_resyncs_by_itself(redis_server):
    async def main() -> None:
        cfg = _cfg(redis_server.url)
        m = GatewayMetrics()
        a = Coordination(cfg, m, "a")
        resynced: list[float] = []

        async def resync() -> None:
            resynced.append(time.monotonic())

        a.link.on_resync(resync)
        await a.connect()
        assert a.link.up and len(resynced) == 1
        redis_server.stop()
        await a.sync_round()
        assert not a.link.up and m.coord_fallback._value.get() == 1
        t0 = time.monotonic()
        with pytest.raises(CoordinationUnavailable):
            await a.link.call("get", lambda c: c.get("x"))
        assert time.monotonic() - t0 < 0.01  # no network while down
        redis_server.start()
        for _ in range(20):
            await asyncio.sleep(0.1)
            await a.sync_round()
            if a.link.up:
                break
        assert a.link.up and len(resynced) == 2
        assert m.coord_resyncs._value.get() == 1 and m.coord_fallback._value.get() == 0
        await a.stop()

    asyncio.run(main())


def test_a_frozen_store_costs_at_most_the_op_timeout(redis_server):
    async def main() -> None:
        a = Coordination(_cfg(redis_server.url), GatewayMetrics(), "a")
        await a.connect()
        redis_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(CoordinationUnavailable):
                await a.link.call("get", lambda c: c.get("x"))
            assert time.monotonic() - t0 < 0.2 * 2 + 0.2
            assert not a.link.up
        finally:
            redis_server.resume()
        await a.link.close()

    asyncio.run(main())
