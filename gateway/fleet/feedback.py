"""What the request path tells the fleet's control plane (the interface it calls).

:class:`gateway.fleet.controller.FleetController` implements it (``Gateway.controller``).
"""

from __future__ import annotations

from typing import Protocol

from gateway.fleet.backend import Backend


class FleetFeedback(Protocol):
    """The control plane as the request path sees it."""

    def auth_refused(self, backend: Backend, detail: str, status: int | None) -> None:
        """``backend`` answered 401/403 (HTTP ``status``; None when unknown) to the
        gateway's own key: a configuration error (``detail`` says where), never a health
        verdict."""

    def breaker_tripped(self, backend: Backend) -> None:
        """``backend``'s circuit breaker just opened (after recording an outcome)."""

    async def refresh_models_soon(self) -> None:
        """A request named a model no backend lists: refresh the model lists now (at most
        once a second)."""
