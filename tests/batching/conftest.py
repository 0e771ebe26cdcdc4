"""Fixtures of the batcher tests: simulated vLLM backends and a gateway in front of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.sim import SimConfig, SimServerThread
from gateway.sim.engine import EngineParams
from tests.support.servers import GatewayThread, gateway_config

MODEL = "m1"


@pytest.fixture
def sim() -> Iterator[Callable[..., SimServerThread]]:
    """Factory ``sim(itl_s=0.01, **SimConfig fields)`` of started simulators serving
    ``m1``, stopped after the test."""
    made: list[SimServerThread] = []

    def make(itl_s: float = 0.01, max_num_seqs: int = 16, **config: Any) -> SimServerThread:
        engine = EngineParams(itl_base_s=itl_s, itl_per_seq_s=0.0, max_num_seqs=max_num_seqs)
        s = SimServerThread(SimConfig(model=MODEL, engine=engine, **config))
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def batching_gateway() -> Iterator[Callable[..., GatewayThread]]:
    """Factory ``batching_gateway([(id, url, max_num_seqs)], **sections)``: a started
    gateway with every backend warm."""
    made: list[GatewayThread] = []

    def make(backends: list[tuple[str, str, int | None]], **sections: Any) -> GatewayThread:
        cfg = gateway_config(
            [{"id": i, "url": u, "max_num_seqs": n} for i, u, n in backends], **sections
        )
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        gw.wait_ready(timeout=20, routable=len(backends))
        return gw

    yield make
    for gw in made:
        gw.stop()
