"""The batcher's decisions with a fake clock: each dispatch reason, no wait at low load,
the wait budget (SLO slack, forecast interval), priority order, flow control, merge units
and the queue bound."""

from __future__ import annotations

from gateway.traffic.batcher import Batcher, BucketSettings, Item, RateView, merge_window_limit

HIGH, NORMAL, LOW = 0, 1, 2


def make(predictive: bool = True, max_queued: int = 100, merge_max: int = 64) -> Batcher:
    return Batcher(
        [BucketSettings(4, 0.002), BucketSettings(8, 0.010), BucketSettings(16, 0.050)],
        max_queued,
        predictive=predictive,
        merge_max=merge_max,
    )


def busy(b: Batcher, rps: float = 10_000.0) -> None:
    """Every bucket forecasts a high, certain arrival rate: batches are expected to fill."""
    for p in range(3):
        b.set_rate(p, RateView(rps, rps, rps))


def add(b: Batcher, prio: int, t: float, name: str = "", key: object = None) -> Item:
    it = Item(prio, "m", t, key, name)
    b.enqueue(it)
    return it


class Binder:
    """Records what was bound; ``room`` places, one per request (None: unlimited)."""

    def __init__(self, room: int | None = None) -> None:
        self.room = room
        self.bound: list[list[str]] = []

    def __call__(self, unit: list[Item]) -> int:
        took = len(unit) if self.room is None else min(len(unit), self.room)
        if self.room is not None:
            self.room -= took
        if took:
            self.bound.append([it.handle for it in unit[:took]])
        return took


def names(bind: Binder) -> list[str]:
    return [n for unit in bind.bound for n in unit]


def test_low_load_dispatches_at_once() -> None:
    """A lone request with no company forecast (0.5 requests/s) goes the moment it comes."""
    b = make()
    b.set_rate(NORMAL, RateView(0.5, 0.2, 0.8))
    add(b, NORMAL, 100.0, "a")
    bind = Binder()
    batches = b.dispatch(100.0, bind)
    assert [(x.reason, x.size) for x in batches] == [("forecast", 1)]
    assert names(bind) == ["a"]


def test_no_forecast_yet_means_no_wait() -> None:
    b = make()
    add(b, LOW, 0.0, "a")
    assert [x.reason for x in b.dispatch(0.0, Binder())] == ["forecast"]


def test_fixed_wait_holds_even_at_low_load() -> None:
    """The fixed-wait batcher (baseline) waits the full max_wait_ms."""
    b = make(predictive=False)
    b.set_rate(NORMAL, RateView(0.5, 0.2, 0.8))
    add(b, NORMAL, 0.0, "a")
    assert b.dispatch(0.005, Binder()) == []
    assert b.next_due_at() == 0.010
    assert [x.reason for x in b.dispatch(0.010, Binder())] == ["timeout"]


def test_full_batch_dispatches() -> None:
    b = make()
    busy(b)
    for i in range(7):
        add(b, NORMAL, 0.0, f"r{i}")
    assert b.dispatch(0.001, Binder()) == []  # 7 of 8, more expected within the wait
    add(b, NORMAL, 0.001, "r7")
    bind = Binder()
    batches = b.dispatch(0.001, bind)
    assert [(x.reason, x.size) for x in batches] == [("full", 8)]
    assert names(bind) == [f"r{i}" for i in range(8)]
    assert b.queued == 0


def test_timeout_dispatches_oldest_wait() -> None:
    b = make()
    busy(b)
    add(b, NORMAL, 1.000, "a")
    add(b, NORMAL, 1.004, "b")
    assert b.dispatch(1.009, Binder()) == []
    batches = b.dispatch(1.010, Binder())
    assert [(x.reason, x.size) for x in batches] == [("timeout", 2)]


def test_forecast_dispatch_when_batch_will_not_fill() -> None:
    """8 places, 10 ms wait: at 100/s about 1 more arrives (< 7 left): go now; at 1000/s
    about 10 arrive (>= 7 left): wait."""
    slow, fast = make(), make()
    slow.set_rate(NORMAL, RateView(100.0, 100.0, 100.0))
    fast.set_rate(NORMAL, RateView(1000.0, 1000.0, 1000.0))
    add(slow, NORMAL, 0.0, "a")
    add(fast, NORMAL, 0.0, "a")
    assert [x.reason for x in slow.dispatch(0.0, Binder())] == ["forecast"]
    assert fast.dispatch(0.0, Binder()) == []
    # as the wait runs out, fewer arrivals fit in what is left of it
    assert [x.reason for x in fast.dispatch(0.004, Binder())] == ["forecast"]


def test_wait_budget_capped_by_half_the_slo_slack() -> None:
    b = make()
    busy(b)
    assert b.wait_budget(LOW) == 0.050
    b.set_slack(0.04)  # TTFT SLO 2 s, P99 TTFT 1.96 s: 40 ms of slack -> at most 20 ms
    assert b.wait_budget(LOW) == 0.020
    b.set_slack(-1.0)  # over the SLO already: no waiting at all
    assert b.wait_budget(LOW) == 0.0
    add(b, LOW, 5.0, "a")
    assert [x.reason for x in b.dispatch(5.0, Binder())] == ["timeout"]


def test_wide_forecast_interval_shrinks_the_wait() -> None:
    b = make()
    b.set_rate(LOW, RateView(100.0, 99.0, 101.0))
    narrow = b.wait_budget(LOW)
    b.set_rate(LOW, RateView(100.0, 0.0, 300.0))  # width 3x the rate
    assert narrow > 0.049
    assert abs(b.wait_budget(LOW) - 0.050 / 4) < 1e-9


def test_higher_priority_dispatches_first() -> None:
    b = make()
    busy(b)
    add(b, LOW, 0.0, "low")
    add(b, NORMAL, 0.0, "normal")
    add(b, HIGH, 0.0, "high")
    bind = Binder()
    b.dispatch(1.0, bind)  # everything timed out
    assert names(bind) == ["high", "normal", "low"]


def test_due_lower_bucket_pulls_higher_first() -> None:
    """A low batch timing out never overtakes a high request still waiting for company."""
    b = make()
    busy(b)
    add(b, LOW, 0.0, "low")
    add(b, HIGH, 0.049, "high")  # its own 2 ms wait has not run out
    bind = Binder()
    batches = b.dispatch(0.050, bind)
    assert [(x.prio, x.reason) for x in batches] == [(HIGH, "priority"), (LOW, "timeout")]
    assert names(bind) == ["high", "low"]


def test_flow_control_holds_requests_until_room() -> None:
    b = make()
    busy(b)
    for i in range(3):
        add(b, LOW, 0.0, f"low{i}")
    add(b, HIGH, 0.0, "high0")
    full = Binder(room=0)
    assert b.dispatch(1.0, full) == []
    assert b.blocked and b.queued == 4
    one = Binder(room=1)
    b.dispatch(1.0, one)  # one place frees: the high request takes it
    assert names(one) == ["high0"]
    add(b, HIGH, 1.5, "high1")  # arrives while low requests still wait
    two = Binder(room=2)
    b.dispatch(1.5, two)
    assert names(two) == ["high1", "low0"]  # then FIFO within the bucket
    rest = Binder()
    b.dispatch(1.5, rest)
    assert names(rest) == ["low1", "low2"] and not b.blocked and b.queued == 0


def test_merge_units_group_equal_keys() -> None:
    b = make(merge_max=2)
    busy(b)
    add(b, LOW, 0.0, "e1", key="emb")
    add(b, LOW, 0.0, "c1", key=None)
    add(b, LOW, 0.0, "e2", key="emb")
    add(b, LOW, 0.0, "x1", key="other")
    add(b, LOW, 0.0, "e3", key="emb")  # merge_max 2: a second group
    bind = Binder()
    b.dispatch(1.0, bind)
    assert bind.bound == [["e1", "e2"], ["c1"], ["x1"], ["e3"]]


def test_partly_bound_merge_group_keeps_the_rest_queued() -> None:
    """A binder that places only part of a merge group (here: a place per request, 3 left)
    sends those 3 merged; the other 2 keep their place at the head of the queue."""
    b = make()
    busy(b)
    for i in range(5):
        add(b, LOW, 0.0, f"e{i}", key="emb")
    three = Binder(room=3)
    b.dispatch(1.0, three)
    assert three.bound == [["e0", "e1", "e2"]]
    assert b.blocked and b.queued == 2
    rest = Binder()
    b.dispatch(1.0, rest)
    assert rest.bound == [["e3", "e4"]]


def test_queue_bound_shares_and_eviction() -> None:
    b = make(max_queued=10)
    for i in range(5):
        add(b, LOW, 0.0, f"low{i}")
    assert not b.admits(LOW)  # low may fill half the queue
    assert b.admits(NORMAL)
    for i in range(5):
        add(b, NORMAL, 0.0, f"n{i}")
    assert not b.admits(NORMAL) and not b.admits(HIGH)
    evicted = b.evict_lowest(HIGH)
    assert evicted is not None and evicted.handle == "low4"
    assert b.evict_lowest(LOW) is None


def test_cancel_removes_a_waiting_request() -> None:
    b = make()
    busy(b)
    it = add(b, NORMAL, 0.0, "a")
    assert b.cancel(it) and not b.cancel(it)
    assert b.dispatch(1.0, Binder()) == [] and b.next_due_at() is None


def test_merge_window_limit_is_nagle_with_a_window() -> None:
    # a small, fresh group goes only to a backend with nothing in flight
    assert merge_window_limit(3, 16, 0.004, 0.010, 3) == 1
    # a full one, or one whose oldest request waited its budget, may join up to the window
    assert merge_window_limit(16, 16, 0.0, 0.010, 3) == 3
    assert merge_window_limit(1, 16, 0.010, 0.010, 3) == 3
    # no window: no limit
    assert merge_window_limit(1, 16, 0.0, 0.010, 0) > 1000


def test_requests_that_cannot_be_placed_do_not_hide_those_that_can() -> None:
    """Model a's backends are full: its 10 queued requests stay, in order, and are offered
    to bind once; model b's request behind them goes now (no head-of-line blocking)."""
    b = make()
    for i in range(10):
        b.enqueue(Item(NORMAL, "a", 0.0, None, f"a{i}"))
    b.enqueue(Item(NORMAL, "b", 0.001, None, "b0"))
    offered: list[str] = []

    def bind(unit: list[Item]) -> int:
        offered.append(unit[0].handle)
        return 0 if unit[0].model == "a" else len(unit)

    batches = b.dispatch(1.0, bind)
    assert [[it.handle for u in x.units for it in u] for x in batches] == [["b0"]]
    assert offered == ["a0", "b0"]  # a1..a9 not offered again after a0 was refused
    assert [it.handle for it in b.queues[NORMAL]] == [f"a{i}" for i in range(10)]
    assert b.blocked


def test_the_scan_past_a_refused_head_is_bounded() -> None:
    b = Batcher(
        [BucketSettings(4, 0.002), BucketSettings(8, 0.010), BucketSettings(16, 0.050)],
        100,
        scan_limit=16,
    )
    for i in range(20):
        b.enqueue(Item(NORMAL, "a", 0.0, None, f"a{i}"))
    b.enqueue(Item(NORMAL, "b", 0.0, None, "b0"))
    batches = b.dispatch(1.0, lambda u: 0 if u[0].model == "a" else len(u))
    assert batches == []  # b0 is beyond the 16 looked at
    assert len(b.queues[NORMAL]) == 21 and b.queues[NORMAL][-1].handle == "b0"


def test_queued_ahead_of_one_model() -> None:
    b = make()
    for i in range(5):
        b.enqueue(Item(NORMAL, "a", 0.0, None, f"a{i}"))
    b.enqueue(Item(HIGH, "b", 0.0, None, "b0"))
    b.enqueue(Item(LOW, "b", 0.0, None, "b1"))
    assert b.queued_ahead(NORMAL) == 6
    assert b.queued_ahead(NORMAL, "b") == 1  # b1 (low) is behind; model a is not counted
    assert b.queued_ahead(LOW, "b") == 2
    assert b.queued_ahead(NORMAL, "c") == 0
