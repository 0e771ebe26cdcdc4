"""The membership rules, pure (gateway/fleet/membership_plan.py): what a discovery snapshot
adds, drains, returns and removes, and when a gone backend may leave the fleet."""

from __future__ import annotations

from gateway.fleet.discovery import Endpoint
from gateway.fleet.membership_plan import (
    MOVED,
    REMOVE_GRACE_S,
    REMOVED,
    TERMINATING,
    Known,
    Leave,
    plan,
    removable,
)


def ep(i: str, url: str | None = None, **conditions: bool) -> Endpoint:
    return Endpoint(id=i, url=url or f"http://{i}:8000", host=i, **conditions)


def test_a_new_serving_endpoint_is_added_and_a_not_ready_one_waits() -> None:
    p = plan({}, [ep("a"), ep("b", serving=False, ready=False), ep("c", terminating=True)], ())
    assert [e.id for e in p.add] == ["a"]
    assert not p.leave and not p.rejoin and not p.gone


def test_a_repeated_id_counts_once_the_first_wins() -> None:
    p = plan({}, [ep("a", "http://x:1"), ep("a", "http://y:1")], ())
    assert [e.url for e in p.add] == ["http://x:1"]


def test_a_terminating_endpoint_that_still_serves_drains_without_a_deadline() -> None:
    known = {"a": Known("http://a:8000")}
    p = plan(known, [ep("a", terminating=True, ready=False)], ())
    assert p.leave == (Leave("a", TERMINATING, False),)
    assert not p.gone  # still in the snapshot: not removed


def test_a_terminating_endpoint_gets_its_deadline_once_it_stops_serving() -> None:
    leaving = {"a": Known("http://a:8000", leaving=True, deadline=False)}
    still = plan(leaving, [ep("a", terminating=True, ready=False)], ())
    assert still.empty  # already draining, still serving: nothing new
    stopped = plan(leaving, [ep("a", terminating=True, ready=False, serving=False)], ())
    assert stopped.leave == (Leave("a", TERMINATING, True),)


def test_a_gone_endpoint_is_drained_with_a_deadline_and_listed_for_removal() -> None:
    known = {"a": Known("http://a:8000"), "b": Known("http://b:8000")}
    p = plan(known, [ep("a")], ())
    assert p.leave == (Leave("b", REMOVED, True),)
    assert p.gone == ("b",)
    again = plan({**known, "b": Known("http://b:8000", True, True)}, [ep("a")], ())
    assert not again.leave and again.gone == ("b",)  # its drain is not started twice


def test_an_endpoint_serving_again_rejoins() -> None:
    leaving = {"a": Known("http://a:8000", leaving=True, deadline=True)}
    assert plan(leaving, [ep("a")], ()).rejoin == ("a",)
    assert plan({"a": Known("http://a:8000")}, [ep("a")], ()).empty  # nothing to undo


def test_a_failing_readiness_probe_alone_changes_nothing() -> None:
    """Not serving, not terminating: the gateway's own probes judge it."""
    p = plan({"a": Known("http://a:8000")}, [ep("a", ready=False, serving=False)], ())
    assert p.empty


def test_a_moved_endpoint_leaves_and_is_added_again_once_out() -> None:
    known = {"a": Known("http://old:8000")}
    p = plan(known, [ep("a", "http://new:8000")], ())
    assert p.leave == (Leave("a", MOVED, True),) and p.gone == ("a",) and not p.add
    after_removal = plan({}, [ep("a", "http://new:8000")], ())
    assert [e.url for e in after_removal.add] == ["http://new:8000"]


def test_static_ids_are_never_touched_and_a_collision_is_reported() -> None:
    p = plan({}, [ep("s1"), ep("a")], {"s1"})
    assert [e.id for e in p.add] == ["a"]
    assert p.collisions == ("s1",)
    # the static backend is not in `known`: a snapshot without it removes nothing
    assert plan({}, [], {"s1"}).empty


def test_an_empty_snapshot_drains_every_discovered_backend() -> None:
    known = {"a": Known("http://a:8000"), "b": Known("http://b:8000")}
    p = plan(known, [], {"s1"})
    assert {lv.id for lv in p.leave} == {"a", "b"} and set(p.gone) == {"a", "b"}


def test_removable_when_idle_or_past_the_deadline_and_its_grace() -> None:
    assert removable(0, None, now=0.0)
    assert not removable(2, None, now=1e9)  # no deadline: waits for its requests
    assert not removable(1, 100.0, now=100.0 + REMOVE_GRACE_S - 0.1)
    assert removable(1, 100.0, now=100.0 + REMOVE_GRACE_S)
