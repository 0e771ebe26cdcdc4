"""Drives the pure ``Engine`` in real time on an asyncio loop.

One background task sleeps until ``engine.next_event_time()`` (or until a submit or
abort wakes it), calls ``engine.advance(now)`` and hands each event to the queue of
the request it belongs to. Engine time is seconds since ``start()`` on the loop's
monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gateway.sim.engine import Engine, EngineParams
from gateway.sim.engine_types import EngineEvent, EngineRequest, RequestMetrics

log = logging.getLogger(__name__)


class EngineRunner:
    """Real-time asyncio driver of one ``Engine``; finished requests go to ``on_finished``."""

    def __init__(
        self,
        params: EngineParams,
        on_finished: Callable[[RequestMetrics], None] | None = None,
        *,
        ttft_factor: float = 1.0,
        itl_factor: float = 1.0,
    ) -> None:
        """``ttft_factor`` / ``itl_factor``: the build's step-time factors, handed to
        :class:`gateway.sim.engine.Engine`."""
        self.engine = Engine(params, ttft_factor=ttft_factor, itl_factor=itl_factor)
        self._on_finished = on_finished
        self._queues: dict[str, asyncio.Queue[EngineEvent]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def now(self) -> float:
        """Engine time: seconds since ``start()``."""
        loop = self._loop or asyncio.get_running_loop()
        return loop.time() - self._t0

    async def start(self) -> None:
        """Start the loop task (idempotent)."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()  # bound to this loop
        # Engine time must never go back, also across a stop/start.
        self._t0 = self._loop.time() - self.engine.stats().time
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")

    async def stop(self) -> None:
        """Stop the loop task and wake every waiting request with an "abort" event."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        now = self.now() if self._loop else 0.0
        for rid, q in list(self._queues.items()):
            q.put_nowait(EngineEvent(rid, now, 0, False, "abort"))
        self._queues.clear()

    def submit(
        self, request: EngineRequest, queue: asyncio.Queue[EngineEvent] | None = None
    ) -> asyncio.Queue[EngineEvent]:
        """Queue ``request`` in the engine; its events arrive on ``queue`` (new if None).

        Several requests may share one queue (events carry ``request_id``).
        """
        q: asyncio.Queue[EngineEvent] = queue if queue is not None else asyncio.Queue()
        self.engine.submit(request, self.now())
        self._queues[request.request_id] = q
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        """Client-side abort (disconnect): the request leaves the engine, no event follows."""
        self._queues.pop(request_id, None)
        found = self.engine.abort(request_id, self.now())
        if found:
            self._wake.set()
        return found

    def abort_all(self) -> int:
        """Engine-side abort of everything (sleep): each request gets an "abort" event."""
        events = self.engine.abort_all(self.now())
        self._dispatch(events)
        self._wake.set()
        return len(events)

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is not None:
                q.put_nowait(ev)
                if ev.finish_reason is not None:
                    del self._queues[ev.request_id]
        if self._on_finished is not None:
            for m in self.engine.drain_finished():
                try:
                    self._on_finished(m)
                except Exception:  # metrics must never stop the engine
                    log.exception("sim: on_finished failed")

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._dispatch(self.engine.advance(self.now()))
            except Exception:  # keep serving; a bug here must not freeze every request
                log.exception("sim: engine step failed")
                await asyncio.sleep(0.01)
                continue
            t = self.engine.next_event_time()
            if t is None:
                await self._wake.wait()
                continue
            delay = t - self.now()
            if delay <= 0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
