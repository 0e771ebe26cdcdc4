"""The seams through which a backend's holds and calibration baseline are shared by every
replica of a fleet (issue 14, item 2), and their one-process implementation.

The fleet never imports the coordination layer (:mod:`gateway.coord`): :class:`Drains` and
:class:`Calibrator` speak to these protocols, :data:`LOCAL` is today's behaviour (nothing
shared, every decision this process's own), and ``wiring.build_gateway`` hands in the shared
implementation (:class:`gateway.coord.operator.OperatorActions`) in fleet mode.

* :class:`SharedHolds`: a GPU fault's restart hook runs once fleet-wide (the replica that
  claims the restart), and the ``gpu_fault`` / ``restarting`` holds it sets are mirrored on
  every replica.
* :class:`SharedBaselines`: every replica compares a backend against the same calibration
  baseline (the first one offered wins).
"""

from __future__ import annotations

from typing import Protocol

from gateway.fleet.backend import Backend

Baseline = tuple[dict[str, object] | None, str | None]
"""A calibration baseline: ``({prompt: answer}, engine endpoint)`` (``(None, None)``: none)."""


class SharedHolds(Protocol):
    """Holds out of rotation that every replica must agree on."""

    async def claim_gpu_restart(self, backend: Backend, reason: str) -> bool:
        """A GPU fault (``reason``: ``gpu_xid`` / ``gpu_ecc``) was seen on ``backend`` and it
        is held ``gpu_fault`` here: True when this replica runs the restart hook (it claimed
        the restart for the fleet and published the hold), False when another replica
        already did (this one keeps the hold until that replica's ``restarting`` hold
        arrives or an operator undrains the backend)."""
        ...

    def restart_held(self, backend: Backend, hold_s: float) -> None:
        """The restart hook ran: ``backend`` is held ``restarting`` for ``hold_s`` seconds
        (or until the restart is seen); publish it (never waits on a store)."""
        ...


class SharedBaselines(Protocol):
    """The calibration baseline of each backend, one for the fleet."""

    async def offer_baseline(self, backend: Backend, baseline: Baseline) -> Baseline:
        """``baseline`` was taken here for ``backend``: returns the fleet's baseline for it
        (the first one offered; ``baseline`` itself when it is the first, or the fleet's
        cannot be read)."""
        ...


class LocalSharing:
    """One process: every restart claim is this replica's, nothing is published, every
    baseline offered is kept."""

    async def claim_gpu_restart(self, backend: Backend, reason: str) -> bool:
        """Always True: the restart hook runs here."""
        return True

    def restart_held(self, backend: Backend, hold_s: float) -> None:
        """Nothing to publish."""

    async def offer_baseline(self, backend: Backend, baseline: Baseline) -> Baseline:
        """The baseline offered."""
        return baseline


LOCAL = LocalSharing()
"""The one-process implementation (stateless, shared by every gateway in a process)."""
