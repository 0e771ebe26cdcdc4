"""``LoopRunner.stop`` ends every control loop even when a loop body swallowed the
cancellation (Python 3.11's ``asyncio.wait_for`` returns the inner result when it completes
as the cancel arrives, CPython gh-86296). Seen as a gateway worker whose SIGTERM never
finished: the lifespan's shutdown waited forever on a loop that had gone back to sleep."""

from __future__ import annotations

import asyncio

from gateway.fleet.loops import LoopRunner
from gateway.metrics import GatewayMetrics


def test_stop_ends_a_loop_whose_body_swallowed_the_cancel():
    rounds = 0
    swallowed = False

    async def swallowing_body() -> None:
        nonlocal rounds, swallowed
        rounds += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True  # once, as wait_for does when its inner call finished at the
            return  # same moment

    async def main() -> None:
        runner = LoopRunner(GatewayMetrics())
        runner.add_loop("swallower", 0.01, swallowing_body)
        await asyncio.sleep(0.05)
        async with asyncio.timeout(5):
            await runner.stop()

    asyncio.run(main())
    assert rounds == 1  # it stopped right after the swallowed cancel, no second round


def test_stop_ends_ordinary_loops():
    async def body() -> None:
        await asyncio.sleep(0)

    async def main() -> None:
        runner = LoopRunner(GatewayMetrics())
        for i in range(3):
            runner.add_loop(f"l{i}", 0.01, body)
        await asyncio.sleep(0.05)
        async with asyncio.timeout(5):
            await runner.stop()

    asyncio.run(main())
