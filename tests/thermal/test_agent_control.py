"""``llm-gateway agent``'s GPU control endpoint (issue 21). NVML is a double at the pynvml
boundary (a fake driver, the fixture of test_agent.py, plus the calls that set clocks and
power limits); the agent's real HTTP server is called with httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pynvml
import pytest

from gateway.agent import start_agent
from tests.thermal.test_agent import FakeNvml, nvml  # noqa: F401 - the NVML double fixture

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Driver:
    """What the fake driver was told: locked SM clocks and power limits (mW) per GPU."""

    def __init__(self, fake: FakeNvml) -> None:
        self.fake = fake
        self.locked: dict[int, tuple[int, int] | None] = {}
        self.refuse = False


@pytest.fixture
def driver(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> Driver:  # noqa: F811
    d = Driver(nvml)

    def guard() -> None:
        if d.refuse:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    def lock(h: int, lo: int, hi: int) -> None:
        guard()
        d.locked[h] = (lo, hi)

    def reset(h: int) -> None:
        guard()
        d.locked[h] = None

    def set_limit(h: int, mw: int) -> None:
        guard()
        nvml.gpus[h].limit_mw = mw

    patches: dict[str, Any] = {
        "nvmlDeviceGetSupportedMemoryClocks": lambda h: [2619, 1593],
        "nvmlDeviceGetSupportedGraphicsClocks": lambda h, mem: [1980, 1500, 990, 345, 210],
        "nvmlDeviceGetPowerManagementLimitConstraints": lambda h: (200_000, 700_000),
        "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: 700_000,
        "nvmlDeviceSetGpuLockedClocks": lock,
        "nvmlDeviceResetGpuLockedClocks": reset,
        "nvmlDeviceSetPowerManagementLimit": set_limit,
    }
    for name, fn in patches.items():
        monkeypatch.setattr(pynvml, name, fn)
    return d


def _start(revert_after_s: float = 60.0) -> tuple[Any, Any, str]:
    server, _thread, reader = start_agent("127.0.0.1", 0, TOKEN, revert_after_s)
    return server, reader, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def agent(driver: Driver) -> Iterator[str]:
    server, reader, url = _start()
    yield url
    server.shutdown()
    reader.close()


def test_sets_and_clears_clocks_and_power_limit_within_the_gpus_range(
    agent: str, driver: Driver
) -> None:
    r = httpx.post(f"{agent}/control/gpus/1/clocks", json={"max_mhz": 1500}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert driver.locked == {1: (210, 1500)}
    gpu1 = r.json()["gpus"][1]
    assert gpu1["locked_clocks_mhz"] == [210.0, 1500.0]
    assert gpu1["supported_clocks_mhz"] == [210.0, 1980.0]
    r = httpx.post(f"{agent}/control/gpus/0/clocks", json={"max_mhz": 9000}, headers=AUTH)
    assert r.status_code == 400 and 0 not in driver.locked  # out of range: refused, not clamped
    r = httpx.post(f"{agent}/control/gpus/0/power-limit", json={"watts": 200}, headers=AUTH)
    assert r.status_code == 200 and driver.fake.gpus[0].limit_mw == 200_000  # its minimum
    assert r.json()["gpus"][0]["power_limit_w"] == 200.0
    # what the service set is said, so a gateway replica taking over adopts it
    assert [g["power_limit_set"] for g in r.json()["gpus"]] == [True, False]
    assert httpx.delete(f"{agent}/control/gpus/1/clocks", headers=AUTH).status_code == 200
    r = httpx.delete(f"{agent}/control/gpus/0/power-limit", headers=AUTH)
    assert r.status_code == 200 and not r.json()["gpus"][0]["power_limit_set"]
    assert driver.locked[1] is None and driver.fake.gpus[0].limit_mw == 700_000
    # the DCGM metrics are still served on the same port
    assert "DCGM_FI_DEV_SM_CLOCK{" in httpx.get(f"{agent}/metrics").text


def test_refuses_without_the_token_bad_bodies_and_unknown_gpus(agent: str, driver: Driver) -> None:
    r = httpx.post(f"{agent}/control/gpus/0/clocks", json={"max_mhz": 1500})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        f"{agent}/control/gpus/0/clocks",
        json={"max_mhz": 1500},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401 and driver.locked == {}
    r = httpx.post(f"{agent}/control/gpus/0/clocks", json={"max_mhz": "fast"}, headers=AUTH)
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == "max_mhz"
    r = httpx.post(f"{agent}/control/gpus/7/clocks", json={"max_mhz": 1500}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "index"
    driver.refuse = True  # no root, or clocks restricted: the driver says no
    r = httpx.post(f"{agent}/control/gpus/0/clocks", json={"max_mhz": 1500}, headers=AUTH)
    assert r.status_code == 503 and "refused" in r.json()["error"]["message"]


def test_reverts_after_losing_contact_and_on_stop(driver: Driver) -> None:
    server, reader, url = _start(revert_after_s=1.0)
    try:
        httpx.post(f"{url}/control/gpus/0/clocks", json={"max_mhz": 990}, headers=AUTH)
        httpx.post(f"{url}/control/gpus/1/power-limit", json={"watts": 400}, headers=AUTH)
        assert driver.locked[0] == (210, 990) and driver.fake.gpus[1].limit_mw == 400_000
        deadline = time.monotonic() + 15.0
        while driver.locked[0] is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.locked[0] is None and driver.fake.gpus[1].limit_mw == 700_000
        httpx.post(f"{url}/control/gpus/1/clocks", json={"max_mhz": 1500}, headers=AUTH)
    finally:
        server.shutdown()  # stopping reverts what is still set
        reader.close()
    assert driver.locked[1] is None
