"""Discovered backends get their GPU control endpoint (issue 21): ``discovery.template.
gpu_control_url`` with ``{node}`` / ``{host}`` filled in as in ``gpu_metrics_url``. Real HTTP
through uvicorn, simulated vLLM pods whose simulated GPUs serve the agent's control endpoint,
and the local Kubernetes API server DOUBLE (``tests/support/kube_api.py``).

The gateway runs with ``thermal.clocks`` on and the efficiency cap (an idle backend runs at
70% of its clock): a discovered pod whose template made it a control URL gets its GPU
capped through it; one whose endpoint names no node (the template needs ``{node}``) is
served without one, uncapped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.discovery.test_dns_discovery import backends
from tests.lifecycle.support import Sim, admin, wait_for
from tests.support.kube_api import KubeApiDouble, endpoint
from tests.support.servers import GatewayThread, gateway_config
from tests.thermal.conftest import THERMAL

TOKEN = "agent-token"


@pytest.fixture
def kube() -> Iterator[KubeApiDouble]:
    """The Kubernetes API server DOUBLE, started."""
    with KubeApiDouble() as k:
        yield k


def test_a_discovered_backend_gets_its_control_url_from_the_template(
    kube: KubeApiDouble, pods: Callable[..., Sim], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLM_GATEWAY_AGENT_TOKEN", TOKEN)
    gpu = {"control_token": TOKEN, "tick_s": 0.1}
    a, b = pods("127.0.0.2", gpu=gpu), pods("127.0.0.3", gpu=gpu)
    kube.put_slice("vllm-x", [endpoint(a.host, pod="vllm-a", node="127.0.0.2"),
                              endpoint(b.host, pod="vllm-b")],
                   ports=[{"name": "http", "port": a.port}])
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    cfg = gateway_config(
        [],
        discovery={
            "source": "kubernetes",
            "kubernetes": {"kubeconfig": kubeconfig, "namespace": "default",
                           "retry_s": 0.2, "watch_nodes": False},
            "template": {"gpu_metrics_url": f"http://{{host}}:{a.port}/gpu/metrics",
                         "gpu_control_url": f"http://{{node}}:{a.port}"}},
        thermal={**THERMAL, "clocks": {"enabled": True, "interval_s": 0.2,
                                       "efficient_ratio": 0.7, "efficient_after_s": 0.0}},
    )
    gw = GatewayThread(cfg)
    try:
        gw.start(wait_ready=False)
        assert wait_for(lambda: {i for i, x in backends(gw).items() if x["state"] == "warm"}
                        == {"vllm-a", "vllm-b"}, 30), backends(gw)
        config_a = gw.gateway.fleet.get("vllm-a")
        assert config_a is not None
        assert str(config_a.config.gpu_control_url) == f"http://127.0.0.2:{a.port}/"
        # the gateway caps vllm-a's GPU through that URL; the simulated agent obeys
        assert wait_for(lambda: a.server.state.gpus.control.locked.get(0) is not None, 15)
        cap = admin(gw.url, "vllm-a")["gpu"]["clock_cap"]
        assert cap["max_mhz"] == pytest.approx(0.7 * 1980, abs=1)
        assert cap["reason"] == "efficiency"
        # vllm-b's endpoint names no node: no control URL, its GPU left alone
        assert admin(gw.url, "vllm-b")["gpu"]["clock_cap"] is None
        assert b.server.state.gpus.control.locked == {}
    finally:
        gw.stop()
