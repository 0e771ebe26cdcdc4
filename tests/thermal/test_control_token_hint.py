"""A gateway whose agent token is wrong says so once per backend, naming the variable to
fix, not a raw ``HTTPStatusError ... 401`` at every GPU round (issue 21 trial), and still
counts every failed call. Real HTTP:
a gateway in front of a simulated backend whose simulated GPU serves the control endpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.lifecycle.support import Sim, metric_samples, metric_sum
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread


def test_a_wrong_agent_token_is_logged_once_with_the_variable_and_counted_every_round(
    sims: Callable[..., Sim],
    th_gateway: Callable[..., GatewayThread],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MY_AGENT_TOKEN", "wrong")
    caplog.set_level(logging.DEBUG, logger="gateway.fleet.clocks")
    a = sims("a", gpu={"control_token": "right", "tick_s": 0.1})
    gw = th_gateway(
        [{"id": "a", "url": a.url, "gpu_metrics_url": a.url + "/gpu/metrics",
          "gpu_control_url": a.url}],
        thermal={"clocks": {"enabled": True, "agent_token_env": "MY_AGENT_TOKEN"}},
    )  # fmt: skip

    def errors() -> float:
        return metric_sum(metric_samples(gw.url), "gateway_clock_control_errors_total", backend="a")

    assert wait_for(lambda: errors() >= 5, timeout=15)  # a round every 0.1 s
    said = [r for r in caplog.records if r.name == "gateway.fleet.clocks"]
    loud = [r for r in said if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    msg = loud[0].getMessage()
    assert "MY_AGENT_TOKEN" in msg and "thermal.clocks.agent_token_env" in msg and "401" in msg
    assert "HTTPStatusError" not in msg
    assert sum(r.levelno == logging.DEBUG for r in said) >= 3  # the repeats, kept quiet
