"""``GET /gpu/metrics`` of the simulated vLLM over real HTTP: DCGM names, faults, heat."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import SimConfig, SimServerThread
from gateway.sim.gpu import GpuConfig

DCGM = (
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
)


@pytest.fixture(scope="module")
def gpu_sim() -> Iterator[SimServerThread]:
    """A simulator with 2 GPUs (tensor parallel) and a tiny thermal mass (tau ~ 0.1 s), so
    heat shows within a test."""
    server = SimServerThread(
        SimConfig(
            model="gpu-model",
            gpu=GpuConfig(count=2, ambient_c=25.0, thermal_mass_j_per_k=1.0, tick_s=0.05),
        )
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def http(gpu_sim: SimServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gpu_sim.url or "", timeout=10) as c:
        yield c
        c.put("/sim/faults", json={})


def samples(http: httpx.Client) -> dict[tuple[str, str], float]:
    """(metric name, gpu label) -> value (the page must parse with prometheus_client)."""
    r = http.get("/gpu/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    list(text_string_to_metric_families(r.text))  # valid exposition format
    out = {}
    for line in r.text.splitlines():
        if line.startswith("DCGM_"):
            name, rest = line.split("{", 1)
            gpu = rest.split('gpu="', 1)[1].split('"', 1)[0]
            out[(name, gpu)] = float(line.rsplit(" ", 1)[1])
    return out


def test_dcgm_names_and_labels_per_gpu(http: httpx.Client) -> None:
    text = http.get("/gpu/metrics").text
    for name in DCGM:
        assert f"# TYPE {name} " in text
        for gpu in ("0", "1"):
            assert f'{name}{{gpu="{gpu}",UUID="GPU-' in text
    assert 'modelName="NVIDIA H100 80GB HBM3"' in text and 'device="nvidia1"' in text
    s = samples(http)
    assert s[("DCGM_FI_DEV_POWER_MGMT_LIMIT", "0")] == 700.0
    assert s[("DCGM_FI_DEV_SM_CLOCK", "0")] == 1980.0
    assert 25.0 <= s[("DCGM_FI_DEV_GPU_TEMP", "0")] <= 40.0
    assert s[("DCGM_FI_DEV_XID_ERRORS", "0")] == 0.0


def test_vllm_metrics_unchanged(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert "vllm:num_requests_running" in text and "DCGM_" not in text


def test_xid_and_ecc_faults(http: httpx.Client) -> None:
    cfg = http.patch("/sim/faults", json={"xid_errors": 3, "xid_code": 79, "fault_gpu": 1})
    assert cfg.status_code == 200 and cfg.json()["xid_errors"] == 3
    s = samples(http)
    assert s[("DCGM_FI_DEV_XID_ERRORS", "1")] == 79.0
    assert s[("DCGM_FI_DEV_XID_ERRORS", "0")] == 0.0
    http.patch("/sim/faults", json={"ecc_dbe_errors": 2})
    s = samples(http)
    assert s[("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "1")] == 2.0
    assert http.patch("/sim/faults", json={"xid_errors": -1}).status_code == 400


def test_cooling_failure_heats_the_gpus(http: httpx.Client) -> None:
    before = samples(http)[("DCGM_FI_DEV_GPU_TEMP", "0")]
    http.patch("/sim/faults", json={"cooling_failure": True, "cooling_failure_factor": 10.0})
    deadline = time.monotonic() + 10
    temp = before
    while time.monotonic() < deadline:  # idle 70 W x 0.75 K/W: settles near 77 °C
        temp = samples(http)[("DCGM_FI_DEV_GPU_TEMP", "0")]
        if temp >= 60:
            break
        time.sleep(0.1)
    assert temp >= 60 > before
    http.patch("/sim/faults", json={"cooling_failure": False})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        temp = samples(http)[("DCGM_FI_DEV_GPU_TEMP", "0")]
        if temp <= 40:
            break
        time.sleep(0.1)
    assert temp <= 40


def test_load_raises_power(http: httpx.Client) -> None:
    idle = samples(http)[("DCGM_FI_DEV_POWER_USAGE", "0")]
    with httpx.Client(base_url=str(http.base_url), timeout=30) as c:
        import concurrent.futures as cf

        body = {
            "model": "gpu-model",
            "prompt": "hello",
            "max_tokens": 200,
            "ignore_eos": True,
        }
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(c.post, "/v1/completions", json=body) for _ in range(8)]
            busy = idle
            deadline = time.monotonic() + 2.5  # the batch runs about 3 s
            while time.monotonic() < deadline and busy <= idle + 100:
                time.sleep(0.2)
                busy = samples(http)[("DCGM_FI_DEV_POWER_USAGE", "0")]
            assert all(f.result().status_code == 200 for f in futs)
    assert idle == pytest.approx(70.0, abs=1.0)
    assert busy > idle + 100
