"""Warm-up: bring a ``warming`` backend to ``warm``.

A backend enters ``warming`` when its probes pass (from ``cold``, or ``unhealthy`` after
``health.recover_threshold`` passes); :class:`Warmup` then, once per backend at a time:
learns its models (:mod:`gateway.fleet.model_discovery`), sends the warm-up requests at each
batch shape (:func:`gateway.fleet.probes.warm_up`; a failure makes it ``unhealthy``,
``warmup_failed``), has it pass calibration again when it drifted before, or takes its
first calibration baseline, and moves it to ``warm`` (``ready``).
"""

from __future__ import annotations

import asyncio

from gateway.config import LifecycleConfig
from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.calibrator import Calibrator
from gateway.fleet.clients import ControlClients
from gateway.fleet.model_discovery import ModelDiscovery
from gateway.fleet.probes import ProbeEndpoints, warm_up
from gateway.fleet.records import Transition
from gateway.fleet.state import FleetState

S = BackendState


class Warmup:
    """Runs warm-ups (``cfg``: ``warmup_batch_shapes``, ``warmup_max_tokens``). Listens
    to ``state``: every transition to ``warming`` starts one."""

    def __init__(
        self,
        cfg: LifecycleConfig,
        state: FleetState,
        clients: ControlClients,
        discovery: ModelDiscovery,
        calibrator: Calibrator,
        endpoints: ProbeEndpoints,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.clients = clients
        self.discovery = discovery
        self.calibrator = calibrator
        self.endpoints = endpoints
        self._tasks: dict[str, asyncio.Task[None]] = {}
        state.listen(self._on_transition)

    def _on_transition(self, backend: Backend, t: Transition) -> None:
        if t.to_state is S.WARMING:
            self.start(backend)

    def start(self, backend: Backend) -> None:
        """Start ``backend``'s warm-up unless one is running (inside the event loop)."""
        task = self._tasks.get(backend.id)
        if task is not None and not task.done():
            return
        self._tasks[backend.id] = asyncio.get_running_loop().create_task(self.warm(backend))

    def forget(self, backend: Backend) -> None:
        """``backend`` left the fleet: cancel its warm-up (if running) and drop it."""
        task = self._tasks.pop(backend.id, None)
        if task is not None:
            task.cancel()

    async def wait_all(self) -> None:
        """Wait for the warm-ups started so far (their failures are theirs)."""
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def stop(self) -> None:
        """Cancel every warm-up and wait for them to end."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def warm(self, backend: Backend) -> None:
        """Bring a ``warming`` backend to ``warm``: it lists its models, passes the warm-up
        at each batch shape, and (first time only) gives its calibration baseline."""
        await self.discovery.refresh_models(backend)
        if backend.state is not S.WARMING or not backend.models:
            return
        lc = self.cfg
        model = backend.models[0]
        err = await warm_up(
            self.clients.work,
            backend,
            model,
            backend.api_key,
            lc.warmup_batch_shapes,
            lc.warmup_max_tokens,
            self.endpoints,
        )
        if backend.state is not S.WARMING:
            return
        if err is not None:
            backend.note_error(err)
            self.state.transition(backend, S.UNHEALTHY, "warmup_failed")
            return
        unserved = self.endpoints.unserved_detail(backend.id, model)
        if lc.warmup_batch_shapes and unserved is not None:
            self.calibrator.unserved(backend, model, "warmup", unserved)  # passes: no verdict
        if backend.needs_calibration:
            # It drifted before: probes passing is not enough, its answers must match again.
            if not await self.calibrator.calibrate(backend):
                return
            backend.set_needs_calibration(False)
        else:
            await self.calibrator.take_baseline(backend, model)
        if backend.state is S.WARMING:
            self.state.transition(backend, S.WARM, "ready")
