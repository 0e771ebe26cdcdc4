"""The gateway's own policy (load_thermal): load score, ties, affinity (pure, fake clock)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import RoutingWeights
from gateway.core.samples import LoadSample
from gateway.routing.policy import AffinityTable, LoadThermalPolicy, estimated_load, score


class Clock:
    """A settable monotonic clock (seconds)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(eq=False)
class B:
    id: str
    capacity: int | None = 16
    in_flight: int = 0
    load: LoadSample | None = None
    warm_since: float | None = None
    recent_failures: int = 0


def sample(waiting=0.0, running=0.0, kv=0.0, at=100.0, in_flight=0) -> LoadSample:
    return LoadSample(waiting, running, kv, at, in_flight)


def router(clock: Clock) -> LoadThermalPolicy:
    return LoadThermalPolicy(RoutingWeights(), 5.0, AffinityTable(60, 1000, clock), clock)


def test_least_loaded_wins():
    clock = Clock()
    r = router(clock)
    busy = B("busy", load=sample(waiting=3, running=16, kv=0.9))
    idle = B("idle", load=sample())
    assert r.pick([busy, idle]) is idle


def test_kv_cache_usage_breaks_equal_queues():
    clock = Clock()
    r = router(clock)
    full = B("full", load=sample(running=4, kv=0.95))
    empty = B("empty", load=sample(running=4, kv=0.10))
    assert r.pick([full, empty]) is empty


def test_burst_between_scrapes_spreads_over_backends():
    """Both looked idle at the last scrape; in-flight counts steer a burst evenly."""
    clock = Clock()
    r = router(clock)
    a, b = B("a", load=sample()), B("b", load=sample())
    counts = {"a": 0, "b": 0}
    for _ in range(40):
        chosen = r.pick([a, b])
        chosen.in_flight += 1  # what the pipeline does at dispatch
        counts[chosen.id] += 1
    assert counts == {"a": 20, "b": 20}


def test_correction_turns_excess_into_queue_when_capacity_known():
    s = sample(waiting=0, running=15, at=100.0, in_flight=15)
    b = B("b", capacity=16, in_flight=20, load=s)
    waiting, running, _ = estimated_load(b, 100.0, 5.0)
    assert (waiting, running) == (4.0, 16.0)


def test_own_merged_embeddings_are_not_read_as_a_queue():
    """2 merged embeddings requests of 16 inputs each were in flight at the scrape: vLLM
    counted 32 engine requests (16 running, 16 waiting) for what clients sent as 32
    requests carried by 2 upstream ones; the gateway reads no queue (it once shed its own
    merged traffic as saturated)."""
    s = LoadSample(16.0, 16.0, 0.1, 100.0, 2, None, 30)
    for cap in (16, None):
        b = B("b", capacity=cap, in_flight=2, load=s)
        waiting, running, _ = estimated_load(b, 100.0, 5.0)
        assert waiting == 0.0
        assert running == 2.0
    # what others sent to the same backend still counts: 5 more engine requests are 5 more
    # requests (a merged request counts as one)
    s = LoadSample(21.0, 16.0, 0.1, 100.0, 2, None, 30)
    for cap in (16, None):
        b = B("b", capacity=cap, in_flight=2, load=s)
        assert estimated_load(b, 100.0, 5.0)[:2] == (0.0, 7.0)
    # and a real queue beyond the capacity is still a queue
    s = LoadSample(40.0, 16.0, 0.1, 100.0, 2, None, 30)
    assert estimated_load(B("b", capacity=16, in_flight=2, load=s), 100.0, 5.0)[:2] == (
        10.0,
        16.0,
    )


def test_a_backend_never_reads_below_what_the_gateway_has_in_flight_there():
    """A hung backend (or a broken exporter) reports no requests while it holds 6 of the
    gateway's: it still counts 6, so an idle backend beside it wins (a hung backend took
    every request, and one reporting -1000 waiting took 92 of 96)."""
    from gateway.fleet.telemetry import parse_vllm_load

    for cap in (16, None):
        hung = B("hung", capacity=cap, in_flight=6, load=LoadSample(0.0, 0.0, 0.0, 100.0, 6))
        assert sum(estimated_load(hung, 100.0, 5.0)[:2]) == 6.0
        idle = B("idle", capacity=cap, in_flight=0, load=LoadSample(0.0, 0.0, 0.0, 100.0, 0))
        w = RoutingWeights()
        assert score(idle, w, 100.0, 5.0) < score(hung, w, 100.0, 5.0)
    assert parse_vllm_load("vllm:num_requests_waiting -1000\nvllm:num_requests_running NaN\n"
                           "vllm:kv_cache_usage_perc 7\n") == (0.0, 0.0, 1.0)


def test_stale_sample_falls_back_to_in_flight():
    b = B("b", in_flight=3, load=sample(waiting=50, at=0.0))
    assert estimated_load(b, 100.0, 5.0) == (0.0, 3.0, 0.0)
    assert score(b, RoutingWeights(), 100.0, 5.0) == 0.5 * 3 / 16


def test_ties_round_robin():
    clock = Clock()
    r = router(clock)
    bs = [B("a"), B("b"), B("c")]
    picks = [r.pick(bs).id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]


def test_no_candidates():
    assert router(Clock()).pick([]) is None


def test_session_sticks_then_repins_and_does_not_flap_back():
    clock = Clock()
    r = router(clock)
    a, b = B("a"), B("b", in_flight=5)
    assert r.pick([a, b], "s1") is a
    a.in_flight = 10  # even when A gets busier, the session stays (prefix-cache reuse)
    assert r.pick([a, b], "s1") is a
    assert r.pick([b], "s1") is b  # A left the candidates: re-pin to B
    a.in_flight = 0
    assert r.pick([a, b], "s1") is b  # A is back: S1 stays on B
    assert r.pick([a, b], "s2") is a  # a new session may go to A


def test_affinity_ttl_and_bound():
    clock = Clock()
    t = AffinityTable(ttl_s=10, max_entries=2, clock=clock)
    t.pin("x", "a")
    clock.t += 11
    assert t.get("x") is None
    t.pin("1", "a"), t.pin("2", "b"), t.pin("3", "c")
    assert len(t) == 2 and t.get("1") is None and t.get("3") == "c"


def test_requests_that_left_since_the_scrape_leave_its_queue_first():
    """Capacity unknown: a request of the gateway's that was queued when vLLM rendered its
    gauges and has finished since is gone from the queue too (the queue moves up as running
    requests end). It read as a queue of 1 until the next scrape, which outweighed a power
    cap's penalty and sent requests to the capped backend beside an idle one (CI)."""
    idle_now = B("b", capacity=None, in_flight=0, load=sample(waiting=1, in_flight=1))
    assert estimated_load(idle_now, 100.0, 5.0)[:2] == (0.0, 0.0)
    # 4 queued behind 8 running; 3 of the gateway's ended since: 1 queued, 8 running
    full = B("f", capacity=None, in_flight=9, load=sample(waiting=4, running=8, in_flight=12))
    assert estimated_load(full, 100.0, 5.0)[:2] == (1.0, 8.0)
    # more left than were queued: the rest leave the running batch
    drained = B("d", capacity=None, in_flight=2, load=sample(waiting=2, running=8, in_flight=8))
    assert estimated_load(drained, 100.0, 5.0)[:2] == (0.0, 4.0)
    # arrivals are still counted as running (capacity unknown)
    grown = B("g", capacity=None, in_flight=5, load=sample(waiting=1, running=2, in_flight=3))
    assert estimated_load(grown, 100.0, 5.0)[:2] == (1.0, 4.0)
    w = RoutingWeights()
    assert score(idle_now, w, 100.0, 5.0) == score(B("z", capacity=None, load=sample()), w,
                                                   100.0, 5.0)
