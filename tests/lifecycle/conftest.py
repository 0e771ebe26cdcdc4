"""Fixtures of the lifecycle tests: simulated backends and a gateway in front of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.lifecycle.support import Sim
from tests.support.servers import GatewayThread, gateway_config


@pytest.fixture
def sims() -> Iterator[Callable[..., Sim]]:
    """Factory ``sims(name, itl_s=0.01, **SimConfig fields)`` of started simulators,
    stopped after the test."""
    made: list[Sim] = []

    def make(name: str, itl_s: float = 0.01, **config: Any) -> Sim:
        s = Sim(name, itl_s, **config)  # config: max_num_seqs, or SimConfig fields
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def lc_gateway() -> Iterator[Callable[..., GatewayThread]]:
    """Factory ``lc_gateway({"a": url, ...}, wait_routable=None, **config sections)`` -> a
    started gateway that has every backend (or ``wait_routable`` of them) warm. The test
    config (``tests.support.servers.gateway_config``) disables warm-up, calibration and the
    cycles; a test turns on what it exercises."""
    made: list[GatewayThread] = []

    def make(urls: dict[str, str], wait_routable: int | None = None,
             backend: dict[str, Any] | None = None, **sections: Any) -> GatewayThread:
        # backend: fields every backend entry gets (e.g. {"max_num_seqs": 16})
        cfg = gateway_config([{"id": k, "url": u, **(backend or {})} for k, u in urls.items()],
                             **sections)
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=20, routable=len(urls) if wait_routable is None else wait_routable)
        return gw

    yield make
    for gw in made:
        gw.stop()
