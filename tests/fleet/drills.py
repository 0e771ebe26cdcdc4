"""How long the fleet-mode drills run.

The issue's must-hold drills run for minutes (three replicas under load for 2 minutes, 600
requests per minute for a minute, ...). The suite runs each for a shorter span that still
tests the same invariants (the bounds scale with the span), so it stays within CI's 20
minutes; ``benchmarks/fleet_drills.py`` runs the same tests at their full length
(``FLEET_DRILLS=full``) and prints their figures."""

from __future__ import annotations

import os


def drill_s(full_s: float, suite_s: float) -> float:
    """``full_s`` seconds when ``FLEET_DRILLS=full`` is set, else ``suite_s``."""
    return full_s if os.environ.get("FLEET_DRILLS") == "full" else suite_s
