"""Maintenance procedures: at most one per backend at a time (a cycle, a drain, a GPU
restart), each marked on the backend while it runs (``maintenance`` in
``/admin/backends``) and surviving its own failures (logged, counted in
``gateway_loop_errors_total{loop="maintenance_<name>"}``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from gateway.fleet.backend import Backend
from gateway.fleet.state import FleetState
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.fleet")


class Procedures:
    """The procedure running on each backend, by backend id."""

    def __init__(self, state: FleetState, metrics: GatewayMetrics) -> None:
        self.state = state
        self.metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._names: dict[str, str] = {}

    def busy(self, backend: Backend) -> bool:
        """Whether a maintenance procedure (cycle, drain) is running on ``backend``."""
        task = self._tasks.get(backend.id)
        return task is not None and not task.done()

    def running(self, backend: Backend) -> str | None:
        """The name of the procedure running on ``backend`` (None: none)."""
        return self._names.get(backend.id) if self.busy(backend) else None

    def run(
        self, backend: Backend, name: str, coro: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]:
        """Run ``coro`` as the procedure ``name`` on ``backend`` (the caller checks
        :meth:`busy` first: this one replaces the record of any other)."""
        state = self.state

        async def wrapped() -> None:
            state.maintenance_started(backend, name)
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.loop_errors.labels(f"maintenance_{name}").inc()
                log.exception("backend %s: %s failed", backend.id, name)
            finally:
                state.maintenance_ended(backend)

        task = asyncio.get_running_loop().create_task(wrapped())
        # cancelled before it started (e.g. its backend left the fleet at once): the
        # procedure's coroutine was never awaited; close it quietly
        task.add_done_callback(lambda _: coro.close())
        self._tasks[backend.id] = task
        self._names[backend.id] = name
        return task

    def cancel(self, backend: Backend) -> None:
        """Cancel the procedure running on ``backend``, if any."""
        task = self._tasks.get(backend.id)
        if task is not None and not task.done():
            task.cancel()

    def forget(self, backend: Backend) -> None:
        """``backend`` left the fleet: cancel its procedure (if running) and drop it."""
        self.cancel(backend)
        self._tasks.pop(backend.id, None)
        self._names.pop(backend.id, None)

    async def cancel_and_wait(self, backend: Backend) -> None:
        """Cancel the procedure running on ``backend`` and wait until it has ended (its
        marker cleared), so another can start in its place."""
        task = self._tasks.get(backend.id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        """Cancel every procedure and wait for them to end."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
