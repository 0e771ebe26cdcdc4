"""``/status.json`` and ``/status`` over a simulated backend: an outage is said as such
("major outage": the model has no backend that can serve it) with the backend's move to
``unhealthy`` among the incidents, and neither page shows a backend's URL or key."""

from __future__ import annotations

import httpx
import pytest

from tests.lifecycle.support import Sim
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config


def test_outage_words_incident_and_no_backend_url_or_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STATUS_TEST_BACKEND_KEY", "sk-sim-secret")
    sim = Sim("a", api_key="sk-sim-secret")
    try:
        cfg = gateway_config(
            [{"id": "a", "url": sim.url, "api_key_env": "STATUS_TEST_BACKEND_KEY"}],
            status={"tick_s": 0.1},
        )
        with GatewayThread(cfg) as gw:
            view = httpx.get(gw.url + "/status.json", timeout=5).json()
            assert view["status"] == "operational"
            assert [m["model"] for m in view["models"]] == ["m1"]
            assert view["backends"] == [{"id": "a", "state": "warm", "tier": "unknown",
                                         "models": ["m1"], "maintenance": None}]
            sim.kill()
            assert wait_for(lambda: httpx.get(gw.url + "/status.json", timeout=5)
                            .json()["status"] == "major outage", 15)
            view = httpx.get(gw.url + "/status.json", timeout=5).json()
            model = view["models"][0]
            assert model["availability"]["routable_backends"] == 0
            assert model["reasons"] == ["no backend can serve it (1 unhealthy)"]
            assert ("unhealthy", "a") in {(i["kind"], i["subject"]) for i in view["incidents"]}
            page = httpx.get(gw.url + "/status", timeout=5)
            assert page.headers["content-type"].startswith("text/html")
            assert 'id="overall" class="words major-outage">major outage<' in page.text
            host_port = sim.url.split("://", 1)[1]
            for text in (page.text, httpx.get(gw.url + "/status.json", timeout=5).text):
                assert host_port not in text and "sk-sim-secret" not in text
    finally:
        sim.stop()
