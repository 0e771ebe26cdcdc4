"""When a backend that just joined or came back may be cycled, and the rollout hold (pure
decisions, time injected).

* a backend added to a running fleet (a reload, discovery, the autoscaler: ``Fleet.add``)
  at stagger slot 0 is not due for any cycle before one full period after it joined, and
  the slots still stagger the fleet over the following period;
* a backend warm again after an outage is rebooked a period from its return, never earlier;
* while a rollout runs, the last routable backend of either version is held.
"""

from __future__ import annotations

import zlib

import pytest

from gateway.config import BackendConfig, LifecycleConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.cycles import (
    SPREAD_SLOTS,
    CycleClock,
    CycleKind,
    back_from_outage,
    came_back,
    cycle_started,
    due_cycle,
    joined_cycle_clock,
    spread_slot,
)
from gateway.fleet.fleet import Fleet
from gateway.fleet.lifecycle import may_take_out, rollout_hold
from gateway.fleet.records import Transition

S = BackendState
CFG = LifecycleConfig.model_validate({
    "short": {"every_s": 300}, "medium": {"every_s": 1800, "every_requests": 0},
    "long": {"every_s": 14400},
})


class Clock:
    """A settable monotonic clock (seconds)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_backend_added_at_slot_0_is_due_no_sooner_than_one_period_after_joining():
    assert spread_slot("a2b") == zlib.crc32(b"a2b") % SPREAD_SLOTS == 0
    clock = Clock(5000.0)
    fleet = Fleet([_cfg("a")], lifecycle=CFG, clock=clock)
    clock.t = 9000.0  # joins later, by a reload
    b = fleet.add(_cfg("a2b"))
    # the trial's failure: medium 1.8 s and long 14 s after joining
    for at in (9001.8, 9014.1, 9299.9):
        assert due_cycle(b.cycles, at, 0, CFG) is None, at
    assert due_cycle(b.cycles, 9300.0, 0, CFG) is CycleKind.SHORT
    assert b.cycles.next_medium == 9000.0 + 1800.0
    assert b.cycles.next_long == 9000.0 + 14400.0


def test_joined_clocks_keep_the_stagger_over_the_following_period():
    clocks = [joined_cycle_clock(s, 4, 100.0, CFG) for s in range(4)]
    assert [c.next_medium for c in clocks] == [1900.0, 2350.0, 2800.0, 3250.0]
    last = joined_cycle_clock(SPREAD_SLOTS - 1, SPREAD_SLOTS, 100.0, CFG)
    assert 100.0 + 1800.0 < last.next_medium < 100.0 + 2 * 1800.0
    off = joined_cycle_clock(0, 1, 0.0, LifecycleConfig.model_validate({"long": {"every_s": 0}}))
    assert off.next_long == float("inf")  # a disabled cycle stays disabled


def test_the_gateways_own_start_keeps_its_spread_within_the_first_period():
    fleet = Fleet([_cfg(f"b{i}") for i in range(3)],
                  lifecycle=CFG, clock=Clock(0.0))
    assert [b.cycles.next_medium for b in fleet] == [600.0, 1200.0, 1800.0]


def test_a_backend_back_from_an_outage_is_rebooked_a_period_from_its_return():
    c = CycleClock(300.0, 1800.0, 14400.0)
    cycle_started(c, CycleKind.LONG, 14400.0, 50, CFG)  # the long cycle: drain, restart
    back = 14400.0 + 400.0  # warm again after the restart and warm-up
    came_back(c, 0, SPREAD_SLOTS, back, 70, CFG)
    assert (c.next_short, c.next_medium, c.next_long) == (back + 300, back + 1800, back + 14400)
    assert c.requests_at_medium == 70
    for at in (back + 1.0, back + 299.0):
        assert due_cycle(c, at, 70, CFG) is None
    later = CycleClock(1e9, 1e9, 1e9)  # a due time already later stands
    came_back(later, 0, SPREAD_SLOTS, back, 0, CFG)
    assert (later.next_short, later.next_medium, later.next_long) == (1e9, 1e9, 1e9)


def _t(frm: S, to: S, reason: str = "x") -> Transition:
    return Transition(0.0, frm, to, reason)


@pytest.mark.parametrize("path,back", [
    # the gateway's start, or a join: the first warm is no return
    ([_t(S.COLD, S.WARMING), _t(S.WARMING, S.WARM)], False),
    # a long cycle's restart
    ([_t(S.COLD, S.WARMING), _t(S.WARMING, S.WARM), _t(S.WARM, S.DRAINING),
      _t(S.DRAINING, S.COLD, "restarted"), _t(S.COLD, S.WARMING), _t(S.WARMING, S.WARM)], True),
    # a crash (probes failed) and recovery
    ([_t(S.WARMING, S.WARM), _t(S.WARM, S.UNHEALTHY), _t(S.UNHEALTHY, S.WARMING),
      _t(S.WARMING, S.WARM)], True),
    # the end of a medium cycle: no outage
    ([_t(S.WARMING, S.WARM), _t(S.WARM, S.DRAINING), _t(S.DRAINING, S.COOLDOWN),
      _t(S.COOLDOWN, S.WARM, "cooldown_done")], False),
    ([_t(S.WARMING, S.WARM), _t(S.WARM, S.DRAINING)], False),
])
def test_back_from_outage(path: list[Transition], back: bool):
    assert back_from_outage(path) is back


def _cfg(name: str, version: str | None = None) -> BackendConfig:
    return BackendConfig.model_validate(
        {"id": name, "url": f"http://{name}:1", "model_version": version})


def _backend(name: str, version: str, state: S = S.WARM) -> Backend:
    b = Backend(config=_cfg(name, version))
    b.state, b.models = state, ("m",)
    return b


ROLLOUT = {"m": ("v1", "v2")}


def test_the_last_routable_backend_of_either_version_is_held_while_the_rollout_runs():
    a1, a2, c = _backend("a1", "v1"), _backend("a2", "v1"), _backend("c", "v2")
    fleet = [a1, a2, c]
    assert rollout_hold(c, fleet, ROLLOUT) == (
        "last routable canary backend (v2) of m while its rollout runs")
    assert not may_take_out(c, fleet, LifecycleConfig(), ROLLOUT)
    assert may_take_out(c, fleet, LifecycleConfig())  # no rollout: the last-warm rule only
    assert rollout_hold(c, fleet, {}) is None  # the rollout ended
    assert rollout_hold(a1, fleet, ROLLOUT) is None  # another baseline stays
    a2.state = S.COOLDOWN  # ... until it is out itself
    assert rollout_hold(a1, fleet, ROLLOUT) == (
        "last routable baseline backend (v1) of m while its rollout runs")
    c2 = _backend("c2", "v2")
    assert rollout_hold(c, [*fleet, c2], ROLLOUT) is None  # a second canary carries it
    other = {"other": ("v1", "v2")}
    assert rollout_hold(c, fleet, other) is None  # a rollout of another model
