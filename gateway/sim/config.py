"""Configuration of one simulated vLLM server (``SimConfig``).

The schema is declared in :mod:`gateway.config` (so validating a gateway config never
imports the simulator); this module names it for the simulator's own code.
"""

from __future__ import annotations

from gateway.config import LoraAdapter, ReleaseConfig, SimConfig

__all__ = ["LoraAdapter", "ReleaseConfig", "SimConfig"]
