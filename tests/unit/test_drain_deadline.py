"""Drain and its deadline (gateway.fleet.drain), with a fake clock (no network)."""

from __future__ import annotations

import asyncio

from gateway.config import load_config
from gateway.core.vocab import BackendState, Cut
from gateway.fleet.controller import FleetController
from gateway.fleet.fleet import Fleet
from gateway.metrics import GatewayMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Handle:
    """Stands in for a request's cut handle: records the cut."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def cut(self, reason: str) -> None:
        self.reason = reason


def controller() -> tuple[FleetController, Clock]:
    cfg = load_config(None, backends=[{"id": "a", "url": "http://h:1"},
                                      {"id": "b", "url": "http://h:2"}])
    clock = Clock()
    fleet = Fleet.from_config(cfg, clock)
    for b in fleet:
        b.state, b.models = BackendState.WARM, ("m",)
    return FleetController(cfg, fleet, GatewayMetrics(), clock=clock, wall=clock), clock


async def test_drain_waits_for_in_flight_then_reports_drained():
    c, _clock = controller()
    b = c.fleet.get("a")
    b.in_flight = 2
    task = asyncio.create_task(c.drains.drain(b, 60.0, "test"))
    await asyncio.sleep(0.12)
    assert b.state is BackendState.DRAINING and not task.done()
    b.in_flight = 0
    assert await asyncio.wait_for(task, 1) is True
    assert b.history[-1].reason == "test"


async def test_deadline_expiry_cuts_remaining_requests_then_completes():
    c, clock = controller()
    b = c.fleet.get("a")
    handles = [Handle(), Handle()]
    b.active.update(handles)
    b.in_flight = 2
    task = asyncio.create_task(c.drains.drain(b, 30.0, "test"))
    await asyncio.sleep(0.12)
    assert all(h.reason is None for h in handles)  # before the deadline nothing is cut
    clock.t += 29.9
    await asyncio.sleep(0.12)
    assert all(h.reason is None for h in handles)
    clock.t += 0.2  # deadline passed
    await asyncio.sleep(0.12)
    assert [h.reason for h in handles] == [Cut.DRAIN_DEADLINE] * 2
    assert not task.done()  # still waiting for the cut requests to leave
    b.in_flight = 0
    assert await asyncio.wait_for(task, 1) is True
    assert c.drains.longest_drain_s >= 30.0


async def test_drain_gives_up_when_state_changes():
    c, _clock = controller()
    b = c.fleet.get("a")
    b.in_flight = 1
    task = asyncio.create_task(c.drains.drain(b, 60.0, "test"))
    await asyncio.sleep(0.12)
    c.state.transition(b, BackendState.UNHEALTHY, "probe_failed")
    assert await asyncio.wait_for(task, 1) is False
