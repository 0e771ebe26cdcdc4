"""The control loops' runner: each loop body every interval, surviving its own failures.

A loop body that raises is logged and counted (``gateway_loop_errors_total{loop}``) and the
loop goes on; each success exports its time (``gateway_loop_last_success_timestamp_seconds
{loop}``, unix seconds). :meth:`LoopRunner.stop` cancels them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")

LoopBody = Callable[[], Awaitable[None]]


class LoopRunner:
    """Runs named loops on the event loop (``wall``: unix seconds, for the success time)."""

    def __init__(self, metrics: GatewayMetrics, wall: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.wall = wall
        self._tasks: list[asyncio.Task[None]] = []

    def add_loop(self, name: str, interval_s: float, body: LoopBody) -> None:
        """Run ``body`` every ``interval_s`` seconds (after each run ends) until
        :meth:`stop`, as a control loop named ``name``. Call it from inside the running
        event loop."""
        self._tasks.append(asyncio.create_task(self._loop(name, interval_s, body)))

    async def stop(self) -> None:
        """Cancel every loop and wait for them to end."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, name: str, interval: float, body: LoopBody) -> None:
        gauge = self.metrics.loop_last_success.labels(name)
        errors = self.metrics.loop_errors.labels(name)
        task = asyncio.current_task()
        while True:
            try:
                await body()
                gauge.set(self.wall())
            except asyncio.CancelledError:
                raise
            except Exception:
                errors.inc()
                log.exception("control loop %s failed; continuing", name)
            if task is not None and task.cancelling():
                # stop() cancelled this loop but the body swallowed it (Python 3.11's
                # asyncio.wait_for returns an inner result that completes as the cancel
                # arrives, CPython gh-86296): end here, or stop() would wait forever
                raise asyncio.CancelledError
            await asyncio.sleep(interval)
