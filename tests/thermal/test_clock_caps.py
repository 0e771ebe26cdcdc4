"""Clocks before shedding end to end (issue 21): the real gateway under uvicorn, two simulated
vLLM backends whose simulated GPUs draw power with their load and serve the agent's GPU
control endpoint, one power domain whose budget their load exceeds, and the ``openai`` SDK
as the client. The gateway brings the domain under its budget by capping clocks, and no
request is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.lifecycle.support import Sim, admin, metric_samples, metric_sum
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread
from tests.thermal.clock_support import controlled_domain, domain, full_load

BUDGET_W = 800.0  # two H100s under this load draw about 1,000 W uncapped


def test_a_domain_over_budget_is_brought_under_it_by_clock_caps_with_no_429(
    sims: Callable[..., Sim],
    th_gateway: Callable[..., GatewayThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, gw = controlled_domain(sims, th_gateway, monkeypatch, BUDGET_W, step_ratio=0.15)
    statuses: list[int] = []
    with full_load(gw, statuses):
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
    assert statuses and set(statuses) == {200}  # no 429: clocks, not shedding
    m = metric_samples(gw.url)
    assert metric_sum(m, "gateway_clock_caps_total", reason="power") >= 1
    assert metric_sum(m, "gateway_admission_rejections_total", layer="power") == 0
