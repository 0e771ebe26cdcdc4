"""The scheduler's bound changed at run time (fleet mode's capacity share): pure."""

from __future__ import annotations

from gateway.core.vocab import Prio
from gateway.traffic.scheduler import Scheduler


def test_a_lower_bound_cuts_nothing_and_passes_no_slot_on_until_below_it():
    s = Scheduler(4, 10)
    for _ in range(4):
        assert s.offer(Prio.NORMAL, 0.0).action == "run"
    assert s.offer(Prio.HIGH, 0.0).action == "queue"
    s.enqueue(Prio.HIGH, "w-high")
    assert s.resize(2, 0.0) == []
    assert s.in_flight == 4  # running requests keep their slots
    assert s.release(1.0, 1.0) is None and s.in_flight == 3
    assert s.release(1.0, 1.0) is None and s.in_flight == 2
    assert s.release(1.0, 1.0) == "w-high" and s.in_flight == 2  # now below: passed on


def test_a_higher_bound_wakes_waiters_most_urgent_first():
    s = Scheduler(1, 10)
    assert s.offer(Prio.LOW, 0.0).action == "run"
    for prio, w in ((Prio.LOW, "low"), (Prio.HIGH, "high"), (Prio.NORMAL, "normal")):
        assert s.offer(prio, 0.0).action == "queue"
        s.enqueue(prio, w)
    assert s.resize(3, 0.0) == ["high", "normal"]
    assert s.in_flight == 3 and s.queued == 1
    assert s.capacity == 3


def test_a_bound_of_zero_queues_everything_and_keeps_a_service_rate():
    s = Scheduler(2, 10)
    s.resize(0, 0.0)
    assert s.offer(Prio.HIGH, 0.0).action == "queue"
    assert s.capacity == 1


def test_unbound_wakes_every_waiter_and_then_runs_everything():
    """Discovery added a backend that states no max_num_seqs: the bound goes."""
    s = Scheduler(1, 10)
    assert s.offer(Prio.NORMAL, 0.0).action == "run"
    for prio, w in ((Prio.LOW, "low"), (Prio.HIGH, "high")):
        assert s.offer(prio, 0.0).action == "queue"
        s.enqueue(prio, w)
    assert s.unbound(0.0) == ["high", "low"]
    assert s.in_flight == 3 and s.queued == 0
    assert s.offer(Prio.LOW, 0.0).action == "run"
