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
    assert s.release(1.0, 1.0, prio=Prio.NORMAL) is None and s.in_flight == 3
    assert s.release(1.0, 1.0, prio=Prio.NORMAL) is None and s.in_flight == 2
    assert s.release(1.0, 1.0, prio=Prio.NORMAL) == "w-high" and s.in_flight == 2  # passed on
    assert s.running == [1, 1, 0]


def test_a_higher_bound_wakes_waiters_most_urgent_first():
    s = Scheduler(1, 10)
    assert s.offer(Prio.LOW, 0.0).action == "run"
    for prio, w in ((Prio.LOW, "low"), (Prio.HIGH, "high"), (Prio.NORMAL, "normal")):
        assert s.offer(prio, 0.0).action == "queue"
        s.enqueue(prio, w)
    assert s.resize(3, 0.0) == ["high", "normal"]
    assert s.in_flight == 3 and s.queued == 1
    assert s.running == [1, 1, 1]  # the low one that ran, then the two woken
    assert s.capacity == 3


def test_a_bound_of_zero_queues_everything_and_keeps_a_service_rate():
    s = Scheduler(2, 10)
    s.resize(0, 0.0)
    assert s.offer(Prio.HIGH, 0.0).action == "queue"
    assert s.capacity == 1


def test_a_new_queue_bound_applies_to_new_offers_and_keeps_the_waiters():
    s = Scheduler(1, 10)
    assert s.offer(Prio.HIGH, 0.0).action == "run"
    for i in range(4):
        assert s.offer(Prio.HIGH, 0.0).action == "queue"
        s.enqueue(Prio.HIGH, f"w{i}")
    s.resize(1, 0.0, max_queued=3)
    assert s.queued == 4 and s.max_queued == 3  # waiters beyond it keep their places
    assert s.offer(Prio.HIGH, 0.0).action == "reject"


def test_a_replicas_capacity_share_takes_the_same_share_of_the_queue():
    """Fleet mode: a replica holding a third of the fleet's slots queues a third of
    ``admission.max_queued`` (rounded up), so its queue drains in the time one gateway's
    would and its refusals' Retry-After stays one gateway's (before: every replica kept the
    whole queue at a third of the rate, and said 3 x longer waits)."""
    from gateway.config import load_config
    from gateway.fleet.fleet import Fleet
    from gateway.flow.admission import AdmissionGate
    from gateway.metrics import GatewayMetrics

    cfg = load_config(None, admission={"max_in_flight": 30, "max_queued": 100})
    gate = AdmissionGate(cfg, Fleet(cfg.backends), GatewayMetrics(), clock=lambda: 0.0)
    assert gate.scheduler.max_queued == 100
    gate.set_capacity_share(10, 10.0)
    assert gate.scheduler.max_in_flight == 10 and gate.scheduler.max_queued == 34
    gate.set_capacity_share(1, 0.2)
    assert gate.scheduler.max_queued == 1  # never below one place
    gate.set_capacity_share(30, 30.0)
    assert gate.scheduler.max_queued == 100


def test_unbound_wakes_every_waiter_and_then_runs_everything():
    """Discovery added a backend that states no max_num_seqs: the bound goes."""
    s = Scheduler(1, 10)
    assert s.offer(Prio.NORMAL, 0.0).action == "run"
    for prio, w in ((Prio.LOW, "low"), (Prio.HIGH, "high")):
        assert s.offer(prio, 0.0).action == "queue"
        s.enqueue(prio, w)
    assert s.unbound(0.0) == ["high", "low"]
    assert s.in_flight == 3 and s.queued == 0 and s.running == [1, 1, 1]
    assert s.offer(Prio.LOW, 0.0).action == "run"
