"""Fixtures of the thermal tests: DCGM exporter stand-ins, simulated backends, a gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.lifecycle.conftest import sims  # noqa: F401 (fixture)
from tests.support.servers import GatewayThread, gateway_config
from tests.thermal.support import DcgmStub, Gpu

# Fast GPU telemetry for tests; thresholds stay the defaults (75 / 85 / 70 °C). The trend
# window is short because tests change temperatures in steps, not along a physical curve.
THERMAL = {"scrape_interval_s": 0.1, "scrape_timeout_s": 1.0, "stale_after_s": 2.0,
           "cooldown_s": 0.5, "max_cooldown_s": 60.0, "trend_window_s": 1.0}


@pytest.fixture
def exporters() -> Iterator[Callable[..., DcgmStub]]:
    """Factory ``exporters(gpus=1, **Gpu fields)`` of started DCGM stand-ins."""
    made: list[DcgmStub] = []

    def make(gpus: int = 1, **values: Any) -> DcgmStub:
        stub = DcgmStub([Gpu(**values) for _ in range(gpus)])
        made.append(stub)
        return stub

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def th_gateway() -> Iterator[Callable[..., GatewayThread]]:
    """Factory ``th_gateway([{"id", "url", "gpu_metrics_url", ...}], **sections)`` -> a
    started gateway with every backend (or ``wait_routable``) warm; fast GPU telemetry."""
    made: list[GatewayThread] = []

    def make(backends: list[dict[str, Any]], wait_routable: int | None = None,
             **sections: Any) -> GatewayThread:
        sections["thermal"] = {**THERMAL, **sections.get("thermal", {})}
        lc = {"drain_deadline_s": 2.0, **sections.pop("lifecycle", {})}
        cfg = gateway_config(backends, lifecycle=lc, **sections)
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=20,
                      routable=len(backends) if wait_routable is None else wait_routable)
        return gw

    yield make
    for gw in made:
        gw.stop()
