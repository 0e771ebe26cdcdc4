"""Clocks before shedding end to end (issue 21): the real gateway under uvicorn, two simulated
vLLM backends whose simulated GPUs draw power with their load and serve the agent's GPU
control endpoint, one power domain whose budget their load exceeds, and the ``openai`` SDK
as the client. The gateway brings the domain under its budget by capping clocks, and no
request is refused."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import Sim, admin, metric_samples, metric_sum, sdk, sdk_kwargs
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

TOKEN = "agent-token"
BUDGET_W = 800.0  # two H100s under this load draw about 1,000 W uncapped


def domain(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/backends", timeout=5).json()
    return {d["name"]: d for d in r["power_domains"]}["r1"]  # type: ignore[no-any-return]


def test_a_domain_over_budget_is_brought_under_it_by_clock_caps_with_no_429(
    sims: Callable[..., Sim],
    th_gateway: Callable[..., GatewayThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        power_domains=[{"name": "r1", "budget_w": BUDGET_W}],
        thermal={"clocks": {"enabled": True, "interval_s": 0.2, "step_ratio": 0.15}},
    )
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:  # keeps every batch slot of both backends busy
        client = sdk(gw.url).with_options(max_retries=0)
        while not stop.is_set():
            try:
                r = client.chat.completions.with_raw_response.create(**sdk_kwargs(max_tokens=60))
                statuses.append(r.http_response.status_code)
            except openai.APIStatusError as e:  # a 429 is recorded, not retried
                statuses.append(e.status_code)

    workers = [threading.Thread(target=load, daemon=True) for _ in range(16)]
    for w in workers:
        w.start()
    try:
        # uncapped, the load takes the domain over its budget ...
        assert wait_for(lambda: domain(gw)["draw_w"] > BUDGET_W, timeout=20)
        # ... then the caps bring it under, while the load goes on
        def capped_under_budget() -> bool:
            gpus = [admin(gw.url, s.name)["gpu"] for s in (a, b)]
            capped = any(
                g["clock_cap"]["max_mhz"] is not None
                and g["clock_cap"]["reason"] == "power"
                and g["sm_clock_mhz"] < 1980  # the GPU obeys (DCGM_FI_DEV_SM_CLOCK)
                for g in gpus
            )
            return capped and domain(gw)["draw_w"] < BUDGET_W

        assert wait_for(capped_under_budget, timeout=30)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=30)
    assert statuses and set(statuses) == {200}  # no 429: clocks, not shedding
    m = metric_samples(gw.url)
    assert metric_sum(m, "gateway_clock_caps_total", reason="power") >= 1
    assert metric_sum(m, "gateway_admission_rejections_total", layer="power") == 0
