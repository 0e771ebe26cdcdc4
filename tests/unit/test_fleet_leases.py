"""The pure parts of fleet-wide maintenance (:mod:`gateway.fleet.leases`,
:func:`gateway.fleet.cycles.adopt_start`): adopting another replica's cycle start, the
stagger rule over the replicas' leases, how a follower mirrors a lease, when the fleet has
drained, and the one-gateway leases that change nothing. Times are injected numbers."""

from __future__ import annotations

import itertools
import math

import pytest

from gateway.config import BackendConfig, LifecycleConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import CycleClock, CycleKind, adopt_start, cycle_started
from gateway.fleet.leases import (
    LeasePhase,
    LeaseRecord,
    LocalLeases,
    MaintenanceLease,
    MirrorAction,
    drained_everywhere,
    may_take_out_fleet,
    mirror_action,
    stagger_groups,
)
from gateway.fleet.lifecycle import may_take_out

S = BackendState
CFG = LifecycleConfig(
    short={"every_s": 300}, medium={"every_s": 1800, "every_requests": 100}, long={"every_s": 3600}
)


def fleet(n: int, model: str = "m", prefix: str = "b") -> list[Backend]:
    out = []
    for i in range(n):
        b = Backend(config=BackendConfig(id=f"{prefix}{i}", url=f"http://h:{8000 + i}"))
        b.state, b.models = S.WARM, (model,)
        out.append(b)
    return out


# ---- adopting a start booked by another replica ------------------------------------------------

def test_adopting_a_medium_start_moves_medium_and_short_one_period_on_from_it():
    clock = CycleClock(next_short=100.0, next_medium=500.0, next_long=4000.0, requests_at_medium=7)
    adopt_start(clock, CycleKind.MEDIUM, started_at=450.0, requests_served=90, cfg=CFG)
    assert clock.next_medium == 450.0 + 1800
    assert clock.next_short == 450.0 + 300
    assert clock.next_long == 4000.0  # a medium cycle is no long one
    assert clock.requests_at_medium == 90  # the request trigger counts again from now


def test_adopting_never_moves_a_due_time_earlier():
    clock = CycleClock(next_short=1000.0, next_medium=5000.0, next_long=9000.0)
    adopt_start(clock, CycleKind.LONG, started_at=10.0, requests_served=0, cfg=CFG)
    assert (clock.next_short, clock.next_medium, clock.next_long) == (1000.0, 5000.0, 9000.0)


def test_adopting_a_long_start_counts_as_all_three_like_a_local_start():
    local, adopted = CycleClock(0.0, 0.0, 0.0), CycleClock(0.0, 0.0, 0.0)
    cycle_started(local, CycleKind.LONG, 50.0, 3, CFG)
    adopt_start(adopted, CycleKind.LONG, 50.0, 3, CFG)
    assert local == adopted


def test_adopting_with_a_cycle_switched_off_keeps_it_off():
    cfg = LifecycleConfig(short={"every_s": 0})
    clock = CycleClock(math.inf, 10.0, 20.0)
    adopt_start(clock, CycleKind.MEDIUM, 5.0, 0, cfg)
    assert clock.next_short == math.inf


# ---- the stagger rule over every replica -------------------------------------------------------

def test_fleet_stagger_with_no_leases_is_may_take_out_exactly():
    # every combination of states over 4 backends, 2 models (b3 serves both)
    states = (S.WARM, S.DRAINING, S.UNHEALTHY)
    for cfg in (LifecycleConfig(), LifecycleConfig(max_unavailable=2)):
        for combo in itertools.product(states, repeat=4):
            bs = fleet(4)
            bs[2].models = ("m2",)
            bs[3].models = ("m", "m2")
            for b, st in zip(bs, combo, strict=True):
                b.state = st
            for b in bs:
                if b.state is not S.WARM:
                    continue
                fleetwide = may_take_out_fleet(b.id, stagger_groups(b, bs, cfg), set())
                assert fleetwide == may_take_out(b, bs, cfg), (combo, b.id)


def test_a_lease_held_by_another_replica_counts_as_out_though_this_replica_sees_it_warm():
    a, b, c = fleet(3)
    groups = stagger_groups(a, [a, b, c], LifecycleConfig(max_unavailable=1))
    assert may_take_out_fleet("b0", groups, set())
    assert not may_take_out_fleet("b0", groups, {"b1"})  # b1 is in another replica's cycle
    assert may_take_out_fleet("b0", groups, {"x9"})  # a backend of another model does not count
    two = stagger_groups(a, [a, b, c], LifecycleConfig(max_unavailable=2))
    assert may_take_out_fleet("b0", two, {"b1"})
    assert not may_take_out_fleet("b0", two, {"b1", "b2"})  # never the last warm one


# ---- how a follower mirrors another replica's lease ---------------------------------------------

def rec(**kw: object) -> LeaseRecord:
    base: dict[str, object] = dict(
        backend="a", holder="r2", token=4, cycle=CycleKind.MEDIUM, reason="scheduled",
        phase=LeasePhase.DRAINING, open=True, expires_at=110.0,
    )
    base.update(kw)
    return LeaseRecord(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("record", "following", "state", "keep_until", "want"),
    [
        (None, False, S.WARM, None, MirrorAction.NONE),
        (rec(), False, S.WARM, None, MirrorAction.DRAIN),
        (rec(phase=LeasePhase.COOLDOWN), False, S.WARM, None, MirrorAction.DRAIN),
        (rec(phase=LeasePhase.RESTARTING), False, S.WARM, None, MirrorAction.DRAIN),
        (rec(), True, S.DRAINING, 110.0, MirrorAction.KEEP),
        (rec(phase=LeasePhase.COOLDOWN), True, S.DRAINING, 110.0, MirrorAction.COOLDOWN),
        (rec(phase=LeasePhase.COOLDOWN), True, S.COOLDOWN, 110.0, MirrorAction.KEEP),
        (rec(phase=LeasePhase.RESTARTING), True, S.COOLDOWN, 110.0, MirrorAction.RESTART),
        (rec(phase=LeasePhase.RESTARTING), True, S.COLD, 110.0, MirrorAction.KEEP),
        (rec(), False, S.UNHEALTHY, None, MirrorAction.KEEP),  # already out: nothing to do
        (rec(open=False), True, S.COOLDOWN, 110.0, MirrorAction.RETURN),
        (rec(open=False), True, S.COLD, 110.0, MirrorAction.NONE),  # restarted: probes
        (rec(open=False, phase=LeasePhase.RESTARTING), True, S.DRAINING, 110.0,
         MirrorAction.RESTART),  # ended restarting, a round missed: cold, not warm
        (rec(open=False), False, S.WARM, None, MirrorAction.NONE),
        (None, True, S.COOLDOWN, 120.0, MirrorAction.KEEP),  # nothing read: as last seen
        (None, True, S.COOLDOWN, 99.0, MirrorAction.RETURN),  # ... until it would have ended
        (rec(expires_at=None), True, S.COOLDOWN, 110.0, MirrorAction.TAKE_OVER),
        (rec(expires_at=100.0), True, S.COOLDOWN, 110.0, MirrorAction.TAKE_OVER),
        (rec(cycle=CycleKind.SHORT, phase=LeasePhase.PROBING), False, S.WARM, None,
         MirrorAction.NONE),
    ],
)
def test_mirror_action(record, following, state, keep_until, want):
    assert mirror_action(record, following, state, 100.0, keep_until) is want


# ---- the holder's wait for every replica's drain ------------------------------------------------

def test_drained_everywhere_needs_a_zero_from_every_other_live_replica_for_this_cycle():
    assert drained_everywhere({}, 3, [])  # alone
    assert not drained_everywhere({}, 3, ["r2"])  # r2 has not reported yet
    assert not drained_everywhere({"r2": "3:1"}, 3, ["r2"])  # one request still in flight
    assert not drained_everywhere({"r2": "2:0"}, 3, ["r2"])  # a report for an older cycle
    assert drained_everywhere({"r2": "3:0", "gone": "3:5"}, 3, ["r2"])  # gone: not live
    assert not drained_everywhere({"r2": "3:0"}, 3, ["r2", "r3"])


# ---- one gateway: leases that change nothing --------------------------------------------------

def test_local_leases_grant_at_once_without_suspending():
    (b,) = fleet(1)
    leases = LocalLeases()
    coro = leases.acquire(b, CycleKind.MEDIUM, "scheduled", 42.0)
    with pytest.raises(StopIteration) as done:  # finished on its first step: no suspension
        coro.send(None)
    lease = done.value.value
    assert isinstance(lease, MaintenanceLease)
    assert (lease.backend, lease.phase, lease.drain_deadline) == ("b0", LeasePhase.DRAINING, 42.0)
    assert leases.confirmed(lease) and not leases.shared
    short = leases.acquire(b, CycleKind.SHORT, "scheduled", None)
    with pytest.raises(StopIteration) as done:
        short.send(None)
    assert done.value.value.phase is LeasePhase.PROBING


def test_a_lease_counts_its_changes_and_loses_only_when_told():
    lease = MaintenanceLease("a", CycleKind.MEDIUM, "thermal", LeasePhase.DRAINING)
    lease.enter(LeasePhase.DRAINING)
    assert lease.version == 0  # no change
    lease.enter(LeasePhase.COOLDOWN)
    lease.mark_reset()
    lease.mark_reset()
    lease.mark_slept(True)
    lease.resting_until(5.0)
    assert lease.version == 4 and lease.reset_done and lease.slept and lease.rest_end == 5.0
    assert not lease.lost
    lease.lose()
    assert lease.lost
