"""Shared set-up of the clocks-before-shedding end-to-end tests (issue 21): one power domain
``r1`` of two simulated backends whose simulated GPUs serve the agent's control endpoint,
and a load that keeps every batch slot busy and records each answer's HTTP status."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import Sim, sdk, sdk_kwargs
from tests.support.servers import GatewayThread

TOKEN = "agent-token"


def domain(gw: GatewayThread) -> dict[str, Any]:
    """The ``r1`` power domain as ``/admin/backends`` shows it (``draw_w``, ``budget_w``)."""
    r = httpx.get(gw.url + "/admin/backends", timeout=5).json()
    return {d["name"]: d for d in r["power_domains"]}["r1"]  # type: ignore[no-any-return]


def controlled_domain(
    sims: Callable[..., Sim],
    th_gateway: Callable[..., GatewayThread],
    monkeypatch: pytest.MonkeyPatch,
    budget_w: float,
    step_ratio: float,
) -> tuple[Sim, Sim, GatewayThread]:
    """Backends ``a`` and ``b`` (8 batch slots each, GPU control with :data:`TOKEN`) in
    domain ``r1`` of ``budget_w`` watts, behind a gateway with ``thermal.clocks`` on (one
    step of ``step_ratio`` every 0.2 s)."""
    monkeypatch.setenv("LLM_GATEWAY_AGENT_TOKEN", TOKEN)
    gpu = {"control_token": TOKEN, "tick_s": 0.1}
    a, b = sims("a", max_num_seqs=8, gpu=gpu), sims("b", max_num_seqs=8, gpu=gpu)
    gw = th_gateway(
        [
            {
                "id": s.name,
                "url": s.url,
                "gpu_metrics_url": s.url + "/gpu/metrics",
                "gpu_control_url": s.url,
                "power_domain": "r1",
            }
            for s in (a, b)
        ],
        power_domains=[{"name": "r1", "budget_w": budget_w}],
        thermal={"clocks": {"enabled": True, "interval_s": 0.2, "step_ratio": step_ratio}},
    )
    return a, b, gw


@contextmanager
def full_load(gw: GatewayThread, statuses: list[int], clients: int = 16) -> Iterator[None]:
    """``clients`` SDK clients sending chat completions (no retries) while the block runs;
    every answer's status (a 429 included) is appended to ``statuses``."""
    stop = threading.Event()

    def load() -> None:
        client = sdk(gw.url).with_options(max_retries=0)
        while not stop.is_set():
            try:
                r = client.chat.completions.with_raw_response.create(**sdk_kwargs(max_tokens=60))
                statuses.append(r.http_response.status_code)
            except openai.APIStatusError as e:  # a 429 is recorded, not retried
                statuses.append(e.status_code)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(clients)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
