"""The readiness seam (``gateway.core.readiness``) and the control loops' check
(``LoopRunner.readiness``), with an injected clock: what counts as ready, what a failing or
raising check reports, when a loop counts as stuck."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.readiness import Readiness
from gateway.fleet.loops import MIN_STALL_S, LoopRunner
from gateway.metrics import GatewayMetrics


def test_ready_only_when_every_check_passes_and_a_raising_check_fails():
    r = Readiness()
    assert r.report().ready  # nothing registered: nothing keeps it out
    state = {"ok": True}
    r.add("loops", lambda: (True, "5 control loops running"))
    r.add("discovery", lambda: (state["ok"], "synced" if state["ok"] else "no snapshot yet"))
    assert r.names == ("loops", "discovery")
    assert r.report().ready
    state["ok"] = False
    report = r.report()
    assert not report.ready
    assert [(c.name, c.detail) for c in report.failing] == [("discovery", "no snapshot yet")]

    def broken() -> tuple[bool, str]:
        raise KeyError("gone")

    r.add("broken", broken)
    state["ok"] = True
    (failing,) = r.report().failing
    assert failing.name == "broken" and failing.detail == "the check raised KeyError: 'gone'"
    with pytest.raises(ValueError, match="already registered"):
        r.add("loops", lambda: (True, ""))


async def test_loops_ready_while_running_not_when_stuck_or_stopped():
    now = [1000.0]
    runner = LoopRunner(GatewayMetrics(), wall=lambda: 0.0, clock=lambda: now[0])
    assert runner.readiness() == (False, "control loops not started")
    go = asyncio.Event()

    async def slow_round() -> None:
        await go.wait()

    async def quick_round() -> None:
        return None

    runner.add_loop("quick", 1.0, quick_round)
    runner.add_loop("slow", 10.0, slow_round)  # default bound: max(60, 10 x 10 s) = 100 s
    await asyncio.sleep(0)  # both start their first round
    assert runner.readiness() == (True, "2 control loops running")
    now[0] += 100.0  # at the bound: not yet stuck
    assert runner.readiness()[0]
    now[0] += 1.0
    ok, detail = runner.readiness()
    assert not ok and detail.startswith("control loop stuck: slow (one round running for 101 s")
    go.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert runner.readiness() == (True, "2 control loops running")
    hold = asyncio.Event()

    async def held_round() -> None:
        await hold.wait()

    runner.add_loop("fast", 0.1, held_round)  # a short interval's bound: MIN_STALL_S
    await asyncio.sleep(0)
    now[0] += MIN_STALL_S
    assert runner.readiness()[0]
    now[0] += 0.5
    assert runner.readiness()[1].startswith("control loop stuck: fast (")
    await runner.stop()
    assert runner.readiness() == (False, "control loops stopped")
