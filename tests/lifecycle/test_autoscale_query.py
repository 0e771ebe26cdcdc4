"""``GET /autoscale?model=`` as KEDA's metrics-api scaler and scripts send it: the real
gateway under uvicorn, a simulated vLLM serving a model id with a slash and dots.

A model id with ``/`` and ``.`` is found URL-encoded or not; an empty ``?model=`` or two of
them is a 400 in the OpenAI error shape (it was a 404 ``model_not_found`` for the empty
id, and of two the last was answered silently, as if it were the one asked for)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.sim import SimConfig, SimServerThread
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

MODEL_ID = "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.fixture
def gw() -> Iterator[GatewayThread]:
    sim = SimServerThread(SimConfig(model=MODEL_ID), host="127.0.0.1", port=0)
    url = sim.start()
    cfg = gateway_config([{"id": "a", "url": url}], autoscale={"interval_s": 0.2},
                         forecast={"enabled": False})
    g = GatewayThread(cfg)
    g.start()
    yield g
    g.stop()
    sim.stop()


def test_model_ids_with_slashes_and_dots_encoded_or_not(gw: GatewayThread) -> None:
    def get(query: str) -> httpx.Response:
        return httpx.get(gw.url + "/autoscale" + query, timeout=5)

    assert wait_for(lambda: get("?model=Qwen%2FQwen2.5-1.5B-Instruct").status_code == 200, 10)
    for q in ("?model=Qwen%2FQwen2.5-1.5B-Instruct", "?model=Qwen/Qwen2.5-1.5B-Instruct"):
        r = get(q)
        assert r.status_code == 200 and r.json()["model"] == MODEL_ID, r.text
        assert r.json()["desired_replicas"] >= 1


@pytest.mark.parametrize(
    "query", ["?model=", "?model=%20", f"?model={MODEL_ID}&model=other"]
)
def test_an_empty_or_repeated_model_is_a_400(gw: GatewayThread, query: str) -> None:
    r = httpx.get(gw.url + "/autoscale" + query, timeout=5)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", "model", "invalid_value")
