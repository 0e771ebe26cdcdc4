"""Fixtures for the simulator tests: one shared simulated vLLM per module."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.sim import LoraAdapter, SimConfig, SimServerThread

MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServerThread]:
    """A started simulator (``sim.url``, ``sim.state``), shared by a test module."""
    server = SimServerThread(
        SimConfig(model=MODEL, lora_adapters=[LoraAdapter(name="sim-lora")], seed=7)
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(sim: SimServerThread) -> Iterator[openai.OpenAI]:
    """The real openai SDK pointed at the simulator (no retries)."""
    assert sim.url
    c = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


@pytest.fixture
def http(sim: SimServerThread) -> Iterator[httpx.Client]:
    """A plain httpx client on the simulator's base URL."""
    with httpx.Client(base_url=sim.url or "", timeout=10) as c:
        yield c


@pytest.fixture
def faults(http: httpx.Client) -> Iterator[httpx.Client]:
    """Like ``http``; puts the default FaultConfig back after the test."""
    yield http
    http.put("/sim/faults", json={})
