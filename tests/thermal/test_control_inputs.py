"""The GPU control endpoint refuses what it cannot apply as asked (issue 21 trial): NaN,
Infinity and overflowing numbers, values outside the GPU's supported range (a 400 naming the
range, nothing clamped or changed), and every other method in the OpenAI error shape (no
FastAPI ``{"detail"}``). Over real HTTP, on both servers of the endpoint: ``llm-gateway
agent`` (NVML doubled at the pynvml boundary) and the simulator (uvicorn)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import Sim
from tests.thermal.test_agent import nvml  # noqa: F401 - the NVML double fixture
from tests.thermal.test_agent_control import TOKEN, Driver, _start, driver  # noqa: F401

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLOCKS, POWER = "/control/gpus/0/clocks", "/control/gpus/0/power-limit"


@pytest.fixture(params=["agent", "sim"])
def endpoint(
    request: pytest.FixtureRequest, sims: Callable[..., Sim]
) -> Iterator[str]:
    """The base URL of a control endpoint with the token :data:`TOKEN`."""
    if request.param == "sim":
        yield sims("s", gpu={"control_token": TOKEN}).url
        return
    request.getfixturevalue("driver")
    server, reader, url = _start()
    yield url
    server.shutdown()
    reader.close()


def _state(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/control", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["code"] == "invalid_value", err
    for w in words:
        assert w in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CLOCKS, b'{"max_mhz": NaN}', "max_mhz"),
        (CLOCKS, b'{"max_mhz": 1e999}', "max_mhz"),
        (CLOCKS, b'{"max_mhz": -Infinity}', "max_mhz"),
        (CLOCKS, b'{"max_mhz": 1500, "min_mhz": NaN}', "min_mhz"),
        (CLOCKS, b'{"max_mhz": 1500, "min_mhz": Infinity}', "min_mhz"),
        (POWER, b'{"watts": NaN}', "watts"),
        (POWER, b'{"watts": Infinity}', "watts"),
    ],
)
def test_not_finite_numbers_are_refused_and_change_nothing(
    endpoint: str, path: str, body: bytes, param: str
) -> None:
    before = _state(endpoint)
    r = httpx.post(endpoint + path, content=body, headers=AUTH)
    _refused(r, param, "finite")
    assert _state(endpoint) == before


def test_values_outside_the_gpus_range_are_refused_with_the_range(endpoint: str) -> None:
    before = _state(endpoint)
    gpu = before["gpus"][0]
    lo_mhz, hi_mhz = gpu["supported_clocks_mhz"]
    lo_w, hi_w = gpu["power_limit_range_w"]
    for body, param, limits in (
        ({"max_mhz": hi_mhz + 1}, "max_mhz", (lo_mhz, hi_mhz)),
        ({"max_mhz": lo_mhz - 1}, "max_mhz", (lo_mhz, hi_mhz)),
        ({"max_mhz": hi_mhz, "min_mhz": lo_mhz - 1}, "min_mhz", (lo_mhz, hi_mhz)),
        ({"watts": lo_w - 1}, "watts", (lo_w, hi_w)),
        ({"watts": hi_w + 1}, "watts", (lo_w, hi_w)),
    ):
        path = POWER if "watts" in body else CLOCKS
        r = httpx.post(endpoint + path, json=body, headers=AUTH)
        _refused(r, param, f"{limits[0]:g}-{limits[1]:g}")
    r = httpx.post(endpoint + CLOCKS, json={"max_mhz": lo_mhz, "min_mhz": hi_mhz}, headers=AUTH)
    _refused(r, "min_mhz", "above max_mhz")
    assert _state(endpoint) == before
    # the bounds themselves are in range
    r = httpx.post(endpoint + CLOCKS, json={"max_mhz": hi_mhz, "min_mhz": lo_mhz}, headers=AUTH)
    assert r.status_code == 200 and r.json()["gpus"][0]["locked_clocks_mhz"] == [lo_mhz, hi_mhz]
    r = httpx.post(endpoint + POWER, json={"watts": lo_w}, headers=AUTH)
    assert r.status_code == 200 and r.json()["gpus"][0]["power_limit_w"] == lo_w


@pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "HEAD", "OPTIONS"])
@pytest.mark.parametrize("path", ["/control", CLOCKS, POWER])
def test_every_method_on_every_control_path_answers_in_the_openai_shape(
    endpoint: str, method: str, path: str
) -> None:
    r = httpx.request(method, endpoint + path, json={"max_mhz": 1000}, headers=AUTH)
    if method == "GET" and path == "/control":
        assert r.status_code == 200
        return
    assert r.status_code == 405, r.text
    if method != "HEAD":  # a HEAD answer has no body
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.request(method, endpoint + path, json={"max_mhz": 1000})  # no token: 401 first
    assert r.status_code == 401
    if method != "HEAD":
        assert r.json()["error"]["type"] == "authentication_error"
