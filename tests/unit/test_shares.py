"""Capacity shares between replicas (gateway.traffic.shares.split): pure."""

from __future__ import annotations

from gateway.traffic.shares import split, split_classes


def test_shares_follow_demand_and_sum_to_the_capacity():
    s = split(12, {"r1": 30, "r2": 10, "r3": 0})
    assert sum(s.values()) == 12
    assert s["r3"] == 1  # the floor: an idle replica can still start a request
    assert s["r1"] > s["r2"] > s["r3"]
    assert s == {"r1": 8, "r2": 3, "r3": 1}


def test_equal_demand_splits_evenly_and_no_demand_too():
    assert split(12, {"r1": 5, "r2": 5, "r3": 5}) == {"r1": 4, "r2": 4, "r3": 4}
    assert split(12, {"r1": 0, "r2": 0, "r3": 0}) == {"r1": 4, "r2": 4, "r3": 4}


def test_leftover_slots_are_spread_over_backends_by_the_salt():
    firsts = set()
    for b in ("a", "b", "c", "d", "e", "f"):
        s = split(4, {"r1": 1, "r2": 1, "r3": 1}, salt=b)
        assert sum(s.values()) == 4 and min(s.values()) == 1
        firsts.add(max(s, key=s.get))
    assert len(firsts) > 1  # not always the same replica


def test_same_inputs_same_split_whatever_the_order():
    a = split(10, {"r1": 3, "r2": 7, "r3": 1}, salt="x")
    b = split(10, dict(reversed(list({"r1": 3, "r2": 7, "r3": 1}.items()))), salt="x")
    assert a == b and sum(a.values()) == 10


def test_more_replicas_than_capacity_each_keeps_its_floor():
    assert split(2, {"r1": 9, "r2": 9, "r3": 9}) == {"r1": 1, "r2": 1, "r3": 1}
    assert split(5, {}) == {}


def test_a_lone_replica_gets_the_whole_capacity():
    assert split(12, {"r1": 0}) == {"r1": 12}


def test_high_priority_waiting_at_one_replica_takes_slots_from_low_priority_elsewhere():
    # r1's clients wait at high priority; r2 and r3 hold only low-priority queues
    s = split_classes(12, {"r1": (6, 2, 0), "r2": (0, 2, 30), "r3": (0, 2, 30)})
    assert sum(s.values()) == 12
    assert s["r1"] == 1 + 6 + 1  # its high first, then the normal class split evenly
    # proportional to total demand instead, r1 would get about a ninth
    assert split(12, {"r1": 8, "r2": 32, "r3": 32})["r1"] <= 3


def test_classes_met_in_order_and_the_rest_by_total_demand():
    s = split_classes(10, {"r1": (1, 1, 0), "r2": (0, 1, 0)})
    # floors 2, then high 1 (r1), normal 2, rest 5 by total demand (2:1)
    assert s == {"r1": 1 + 1 + 1 + 3, "r2": 1 + 1 + 2}
