"""The control loops' runner: each loop body every interval, surviving its own failures.

A loop body that raises is logged and counted (``gateway_loop_errors_total{loop}``) and the
loop goes on; each success exports its time (``gateway_loop_last_success_timestamp_seconds
{loop}``, unix seconds). :meth:`LoopRunner.stop` cancels them all.

:meth:`LoopRunner.readiness` is the gateway's ``control_loops`` readiness check
(:mod:`gateway.core.readiness`): the loops are running when they were started, none has
ended, and none is stuck in one round for longer than its stall bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.core.wording import plural
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")

LoopBody = Callable[[], Awaitable[None]]

# A round running longer than this (seconds; or 10 intervals of its loop, if longer) is a
# stuck loop: every round's I/O is bounded by its own timeouts (probes `health.timeout_s`,
# scrapes `telemetry.scrape_timeout_s`, store calls `coordination.op_timeout_s`), each a few
# seconds at most, so a minute is far past any round that is merely slow on a loaded host.
MIN_STALL_S = 60.0
STALL_INTERVALS = 10


@dataclass
class _Loop:
    name: str
    interval_s: float
    stall_after_s: float
    task: asyncio.Task[None] | None = None
    round_started: float | None = None  # monotonic seconds, while a round runs


class LoopRunner:
    """Runs named loops on the event loop (``wall``: unix seconds, for the success time;
    ``clock``: monotonic seconds, for how long a round runs)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.wall = wall
        self.clock = clock
        self._loops: list[_Loop] = []
        self._stopped = False

    def has(self, name: str) -> bool:
        """Whether a loop named ``name`` was added (and not stopped)."""
        return any(lp.name == name for lp in self._loops)

    def add_loop(
        self, name: str, interval_s: float, body: LoopBody, stall_after_s: float | None = None
    ) -> None:
        """Run ``body`` every ``interval_s`` seconds (after each run ends) until
        :meth:`stop`, as a control loop named ``name``. ``stall_after_s``: how long one round
        may run before the loop counts as stuck in :meth:`readiness` (default: the larger of
        :data:`MIN_STALL_S` and :data:`STALL_INTERVALS` intervals). Call it from inside the
        running event loop."""
        if stall_after_s is None:
            stall_after_s = max(MIN_STALL_S, STALL_INTERVALS * interval_s)
        loop = _Loop(name, interval_s, stall_after_s)
        loop.task = asyncio.create_task(self._loop(loop, body))
        self._loops.append(loop)

    async def stop(self) -> None:
        """Cancel every loop and wait for them to end."""
        self._stopped = True
        loops, self._loops = self._loops, []
        tasks = [lp.task for lp in loops if lp.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def readiness(self) -> tuple[bool, str]:
        """The ``control_loops`` readiness check: (running, detail). Not running before the
        first loop is added, after :meth:`stop`, when a loop's task has ended (only a
        ``BaseException`` other than a cancel can end one: its body's exceptions are
        survived), or when a round has run past the loop's stall bound."""
        if self._stopped:
            return False, "control loops stopped"
        if not self._loops:
            return False, "control loops not started"
        now = self.clock()
        ended = [lp.name for lp in self._loops if lp.task is None or lp.task.done()]
        if ended:
            return False, f"control loop ended: {', '.join(ended)}"
        stuck = [
            f"{lp.name} (one round running for {now - lp.round_started:.0f} s, "
            f"bound {lp.stall_after_s:g} s)"
            for lp in self._loops
            if lp.round_started is not None and now - lp.round_started > lp.stall_after_s
        ]
        if stuck:
            return False, f"control loop stuck: {', '.join(stuck)}"
        return True, f"{plural(len(self._loops), 'control loop')} running"

    async def _loop(self, loop: _Loop, body: LoopBody) -> None:
        gauge = self.metrics.loop_last_success.labels(loop.name)
        errors = self.metrics.loop_errors.labels(loop.name)
        task = asyncio.current_task()
        while True:
            loop.round_started = self.clock()
            try:
                await body()
                gauge.set(self.wall())
            except asyncio.CancelledError:
                raise
            except Exception:
                errors.inc()
                log.exception("control loop %s failed; continuing", loop.name)
            finally:
                loop.round_started = None
            if task is not None and task.cancelling():
                # stop() cancelled this loop but the body swallowed it (Python 3.11's
                # asyncio.wait_for returns an inner result that completes as the cancel
                # arrives, CPython gh-86296): end here, or stop() would wait forever
                raise asyncio.CancelledError
            await asyncio.sleep(loop.interval_s)
