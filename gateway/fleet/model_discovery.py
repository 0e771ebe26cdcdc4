"""Model discovery: what each backend serves, from its ``/v1/models`` (the only code that
asks for it and records it on the backends).

The models loop (:meth:`ModelDiscovery.models_round`, every ``telemetry.models_refresh_s``)
asks every backend that is not ``cold``; warm-up asks the backend it warms;
:meth:`ModelDiscovery.refresh_models_soon` asks them all when a request names a model
nobody lists (a LoRA adapter just loaded); :meth:`ModelDiscovery.list_live` asks the
backends in service for the gateway's own ``GET /v1/models``. A backend configured with
``models`` keeps that list (its cards are still kept); a 401/403 is a configuration error
(:meth:`gateway.fleet.state.FleetState.auth_refused`), never a health verdict.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.core.vocab import BackendState
from gateway.fleet.backend import Backend
from gateway.fleet.clients import ControlClients
from gateway.fleet.fleet import Fleet
from gateway.fleet.probes import fetch_models
from gateway.fleet.records import ModelCard
from gateway.fleet.state import FleetState

S = BackendState

# Backends whose models are the fleet's for the gateway's own model list: routable, and
# those only resting (draining, cooldown): the model is still the fleet's while they are
# out of rotation.
LISTED = (S.WARM, S.DRAINING, S.COOLDOWN)


class ModelDiscovery:
    """Learns and records what the backends of ``fleet`` serve (``clock``: monotonic
    seconds)."""

    def __init__(
        self,
        fleet: Fleet,
        state: FleetState,
        clients: ControlClients,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.state = state
        self.clients = clients
        self.clock = clock
        self._last_round = float("-inf")
        self._lock = asyncio.Lock()

    async def models_round(self) -> None:
        """The models loop's body: refresh every backend that is not ``cold``."""
        self._last_round = self.clock()
        await asyncio.gather(
            *(self.refresh_models(b) for b in self.fleet if b.state is not S.COLD)
        )

    async def refresh_models(self, backend: Backend) -> tuple[ModelCard, ...] | None:
        """Ask ``backend``'s ``/v1/models`` and record the answer (its models, unless set
        in config). Returns the cards, or None when it did not answer with a list (the
        reason noted in its last error, or a configuration error for a 401/403)."""
        res = await fetch_models(self.clients.control, backend, backend.api_key)
        if res.status == "auth":
            self.state.auth_refused(backend, res.detail, res.http_status)
            return None
        if res.cards is None:
            backend.note_error(res.detail)
            return None
        if res.status == "ok":
            self.state.clear_config_error(backend)
        backend.models_listed(res.cards)
        return res.cards

    async def refresh_models_soon(self, min_interval_s: float = 1.0) -> None:
        """Refresh every backend's model list now, at most once per ``min_interval_s``
        seconds (concurrent callers wait for the one refresh).

        Used when a request names a model nobody lists (a LoRA adapter just loaded).
        """
        async with self._lock:
            if self.clock() - self._last_round < min_interval_s:
                return
            await self.models_round()

    async def list_live(self) -> list[tuple[Backend, tuple[ModelCard, ...]]]:
        """Ask every backend in service (warm, draining, cooldown) for its models now and
        record the answers; returns those that answered with their cards, in config order
        (empty: none answered)."""
        live = [b for b in self.fleet if b.state in LISTED]
        results = await asyncio.gather(*(self.refresh_models(b) for b in live))
        return [(b, cards) for b, cards in zip(live, results, strict=True) if cards is not None]
