"""Global rate limits' pure side (``gateway.traffic.quota``, times as arguments): chunk
sizing and the low-water mark, admission from the local balance only, pending and refused
verdicts when it is empty, returns of idle quota, settle's debt, the local share while the
store is down and what it owes when the store is back, and the documented overshoot bound
over several replicas sharing one simulated global bucket."""

from __future__ import annotations

import math
import random

import pytest

from gateway.traffic.limits import TokenBucket
from gateway.traffic.quota import (
    SHARE_TOO_SMALL_S,
    GlobalKeyLimiter,
    QuotaBucket,
    chunk_size,
    low_water,
    share_limit,
)


class Store:
    """A stand-in for the shared store's script: one token bucket (the same arithmetic as
    ``coord/quota.py``'s Lua), answered at once when :meth:`land` is called."""

    def __init__(self, limit: int, now: float = 0.0) -> None:
        self.bucket = TokenBucket(limit, 60.0, now)

    def take(self, ask: int, need: int, now: float) -> float:
        level = self.bucket.level(now)
        got = min(ask, math.floor(level)) if level >= need else 0
        self.bucket.take(got, now)
        return got

    def move(self, delta: float, now: float) -> None:
        b = self.bucket
        b.tokens = max(-b.capacity, min(b.capacity, b.level(now) + delta))


class Source:
    """The I/O side as the pure limiter sees it: fetches are recorded, landed by the test."""

    def __init__(self, store: Store | None = None, alive: int = 1) -> None:
        self.store = store
        self.fallback = False
        self.alive = alive
        self.asked: list[tuple[QuotaBucket, int, int]] = []

    def refill(self, limiter: GlobalKeyLimiter, bucket: QuotaBucket, ask: int, need: int) -> None:
        self.asked.append((bucket, ask, need))

    def land(self, now: float) -> None:
        assert self.store is not None
        for b, ask, need in self.asked:
            got = self.store.take(ask, need, now)
            b.granted(got, self.store.bucket.level(now), now)
        self.asked.clear()


def test_chunk_is_a_share_of_the_limit_at_least_one_and_low_water_half_of_it():
    assert chunk_size(600, 0.05) == 30
    assert chunk_size(10, 0.05) == 1
    assert chunk_size(100_000, 0.05) == 5000
    assert low_water(30) == 15 and low_water(1) == 1
    assert share_limit(600, 3) == 200 and share_limit(600, 0) == 600


def test_first_request_is_pending_then_admitted_from_the_fetched_chunk():
    src = Source(Store(600))
    lim = GlobalKeyLimiter("k", 600, None, 0.0, 0.05, src)
    v = lim.check(10, 0.0)
    assert v.pending and not v.admitted
    assert [(ask, need) for _b, ask, need in src.asked] == [(30, 1)]
    assert lim.check(10, 0.0).pending and len(src.asked) == 1, "one fetch in flight per key"
    src.land(0.0)
    v = lim.check(10, 0.0, final=True)
    assert v.admitted and v.limit_requests == 600
    assert v.remaining_requests == 570 + 29, "global remaining plus the unspent chunk"
    assert lim.requests is not None and lim.requests.balance == 29


def test_low_water_prefetch_tops_the_balance_up_to_one_chunk_in_the_background():
    src = Source(Store(600))
    lim = GlobalKeyLimiter("k", 600, None, 0.0, 0.05, src)
    lim.check(1, 0.0)
    src.land(0.0)
    for _ in range(15):  # 30 -> 15: still at the low-water mark
        assert lim.check(1, 0.0).admitted
    assert src.asked == []
    assert lim.check(1, 0.0).admitted  # 14 < 15: the next chunk is asked for
    assert [(ask, need) for _b, ask, need in src.asked] == [(16, 1)]
    for _ in range(14):
        assert lim.check(1, 0.0).admitted, "admitted from the balance while the fetch runs"
    assert lim.check(1, 0.0).pending
    src.land(0.0)
    assert lim.requests is not None and lim.requests.balance == 16


def test_empty_global_bucket_refuses_at_once_with_the_honest_retry_after():
    store = Store(60)  # 1 per second, burst 60
    src = Source(store)
    lim = GlobalKeyLimiter("k", 60, None, 0.0, 0.5, src)  # chunks of 30
    store.bucket.take(60, 0.0)  # other replicas took everything
    lim.check(1, 0.0)
    src.land(0.0)  # nothing granted: the bucket is seen empty
    v = lim.check(1, 0.0, final=True)
    assert not v.admitted and not v.pending and v.reason == "requests per minute"
    v = lim.check(1, 0.5)
    assert not v.pending and v.retry_after_s == pytest.approx(0.5), "1 missing, 0.5 refilled"
    assert src.asked == [], "no fetch while the global bucket is known short"
    assert lim.check(1, 1.0).pending, "refilled enough: worth a fetch"


def test_tokens_larger_than_a_chunk_fetch_what_they_need_and_oversized_never_fit():
    src = Source(Store(100_000))
    lim = GlobalKeyLimiter("k", None, 100_000, 0.0, 0.05, src)
    assert lim.check(8000, 0.0).pending
    assert [(ask, need) for _b, ask, need in src.asked] == [(8000, 8000)]
    src.land(0.0)
    assert lim.check(8000, 0.0, final=True).admitted
    huge = lim.check(200_000, 0.0)
    assert not huge.admitted and math.isinf(huge.retry_after_s) and "exceed" in huge.reason


def test_idle_balance_and_surplus_go_back_debt_is_forwarded():
    store = Store(1000)
    src = Source(store)
    lim = GlobalKeyLimiter("k", None, 1000, 0.0, 0.1, src)  # chunks of 100
    lim.check(50, 0.0)
    src.land(0.0)
    assert lim.check(50, 0.0, final=True).admitted
    b = lim.tokens
    assert b is not None and b.balance == 50
    lim.settle(50, 1, 0.0)  # 49 back: 99, within the chunk
    assert b.balance == 99 and b.sync_delta(0.5, idle_s=2.0) == 0
    lim.refund(50, 0.1)  # 149 > one chunk: 49 wait as surplus
    assert b.balance == 100 and b.sync_delta(0.5, 2.0) == pytest.approx(49)
    assert b.sync_delta(2.2, 2.0) == pytest.approx(100), "idle for 2 s: all of it back"
    assert b.balance == 0 and lim.full(2.2)
    lim.settle(0, 700, 3.0)  # far more than estimated: a debt
    assert b.balance == -700 and not lim.full(3.0)
    d = b.sync_delta(3.0, 2.0)
    assert d == -700 and b.balance == 0
    b.restore(d)  # the store did not take it: kept
    assert b.sync_delta(3.0, 2.0) == -700
    lim.settle(0, 10**12, 4.0)
    assert b.balance == -1000, "at most one minute's limit owed"


def test_local_share_while_the_store_is_down_then_what_it_used_is_owed():
    store = Store(600)
    src = Source(store, alive=3)
    lim = GlobalKeyLimiter("k", 600, None, 0.0, 0.05, src)
    lim.check(1, 0.0)
    src.land(0.0)
    store.bucket.take(570, 0.0)  # the others emptied the global bucket
    lim.check(1, 0.0, final=True)  # balance 29, global seen at 570 (stale)
    src.fallback = True
    admitted = sum(lim.check(1, 0.0).admitted for _ in range(500))
    # the share: 600 / 3 = 200, starting from 29 unspent + 570 / 3 seen (capped at 200)
    assert admitted == 200
    v = lim.check(1, 0.0)
    assert not v.admitted and v.retry_after_s == pytest.approx(0.3), "the share's refill"
    assert sum(lim.check(1, 6.0).admitted for _ in range(100)) == 20, "200 per minute"
    b = lim.requests
    assert b is not None and b.share is not None
    src.fallback = False
    assert lim.check(1, 6.0).pending, "back on chunks: the balance is empty"
    assert b.share is None and b.owed == 220 - 29
    assert b.sync_delta(6.0, 2.0) == 0, "not while a fetch runs"
    src.land(6.0)
    assert b.sync_delta(6.0, 2.0) == -(220 - 29), "charged to the global bucket"


def test_request_larger_than_the_share_waits_for_the_store():
    src = Source(Store(90_000), alive=3)
    lim = GlobalKeyLimiter("k", None, 90_000, 0.0, 0.05, src)
    src.fallback = True
    v = lim.check(40_000, 0.0)
    assert not v.admitted and v.retry_after_s == SHARE_TOO_SMALL_S and v.reason
    assert lim.check(20_000, 0.0).admitted


def test_by_id_call_takes_one_request_without_waiting():
    src = Source(Store(60))
    lim = GlobalKeyLimiter("k", 60, 1000, 0.0, 0.5, src)
    assert lim.take_request(0.0) > 0 and len(src.asked) == 1, "refused, a fetch started"
    src.land(0.0)
    assert lim.take_request(0.0) == 0.0
    assert lim.requests is not None and lim.requests.balance == 29


@pytest.mark.parametrize("replicas", [1, 3, 5])
def test_overshoot_bound_holds_for_replicas_sharing_one_global_bucket(replicas):
    """Simulated minute: replicas admitting at random from one global bucket of 600 per
    minute, fetches landing a few ms later. Admitted in any 60 s window <= L + r * W +
    N * chunk (the documented bound), and close to L + r * W (no hoarding)."""
    rng = random.Random(replicas)
    limit, chunk = 600, 0.05
    store = Store(limit)
    srcs = [Source(store) for _ in range(replicas)]
    lims = [GlobalKeyLimiter("k", limit, None, 0.0, chunk, s) for s in srcs]
    admitted: list[float] = []
    t = 0.0
    while t < 120.0:
        t += rng.expovariate(100.0)  # 100 requests/s offered over all replicas
        i = rng.randrange(replicas)
        for s in srcs:  # fetches started more than 5 ms ago have landed
            if s.asked and rng.random() < 0.5:
                s.land(t)
        v = lims[i].check(1, t)
        if v.pending:
            srcs[i].land(t + 0.002)
            v = lims[i].check(1, t + 0.002, final=True)
        if v.admitted:
            admitted.append(t)
    bound = limit + limit / 60 * 60 + replicas * chunk_size(limit, chunk)
    worst = max(sum(1 for x in admitted if s <= x < s + 60) for s in admitted)
    assert worst <= bound
    first_minute = sum(1 for x in admitted if x < 60)
    assert first_minute >= 1200 - replicas * 30 - 20
