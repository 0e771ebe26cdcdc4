"""``llm-gateway agent``: NVML is replaced at the pynvml boundary only (a fake driver with two
GPUs); the agent's real HTTP endpoint is scraped and read by the gateway's own DCGM parser."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pynvml
import pytest

from gateway.agent import EXIT_NO_GPU, start_agent
from gateway.cli import main
from gateway.fleet.telemetry import parse_dcgm


@dataclass
class FakeGpu:
    temp_c: int = 55
    power_mw: int = 310_000
    limit_mw: int = 700_000
    sm_mhz: int = 1980
    ecc_dbe: int | None = 0  # None: ECC not supported
    util_pct: int = 40  # nvmlUtilization_t.gpu
    fb_used_b: int = 70_000 * 1024 * 1024  # nvmlMemory_t.used / .free (bytes)
    fb_free_b: int = 11_559 * 1024 * 1024
    memory_supported: bool = True


@dataclass
class FakeNvml:
    """What the NVIDIA driver would answer; ``events`` are pending Xid events."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu(), FakeGpu(temp_c=71)])
    events: list[tuple[int, int]] = field(default_factory=list)  # (gpu index, Xid code)
    init_error: int | None = None
    shutdowns: int = 0


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()

    def init() -> None:
        if fake.init_error is not None:
            raise pynvml.NVMLError(fake.init_error)

    def shutdown() -> None:
        fake.shutdowns += 1

    def ecc(h: int, kind: int, counter: int) -> int:
        assert kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        if fake.gpus[h].ecc_dbe is None:
            raise _not_supported()
        return fake.gpus[h].ecc_dbe  # type: ignore[return-value]

    def memory(h: int) -> Any:
        g = fake.gpus[h]
        if not g.memory_supported:
            raise _not_supported()
        return SimpleNamespace(total=g.fb_used_b + g.fb_free_b, used=g.fb_used_b, free=g.fb_free_b)

    def wait(event_set: Any, timeout_ms: int) -> Any:
        if not fake.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        index, code = fake.events.pop(0)
        return SimpleNamespace(device=index, eventData=code)

    patches: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: len(fake.gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlDeviceGetUUID": lambda h: f"GPU-fake-{h}",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetTemperature": lambda h, sensor: fake.gpus[h].temp_c,
        "nvmlDeviceGetPowerUsage": lambda h: fake.gpus[h].power_mw,
        "nvmlDeviceGetPowerManagementLimit": lambda h: fake.gpus[h].limit_mw,
        "nvmlDeviceGetClockInfo": lambda h, clock: fake.gpus[h].sm_mhz,
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(
            gpu=fake.gpus[h].util_pct, memory=10
        ),
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlEventSetCreate": lambda: "event-set",
        "nvmlDeviceRegisterEvents": lambda h, types, event_set: None,
        "nvmlEventSetWait_v2": wait,
        "nvmlEventSetFree": lambda event_set: None,
    }
    for name, fn in patches.items():
        monkeypatch.setattr(pynvml, name, fn)
    return fake


@pytest.fixture
def agent(nvml: FakeNvml) -> Iterator[str]:
    server, _thread, reader = start_agent("127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    reader.close()


def test_agent_serves_dcgm_names_per_gpu(agent: str, nvml: FakeNvml) -> None:
    r = httpx.get(agent, timeout=5)
    assert r.status_code == 200
    temp_lines = [ln for ln in r.text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{")]
    assert len(temp_lines) == 2
    assert all(x in temp_lines[1] for x in ('gpu="1"', 'UUID="GPU-fake-1"', 'device="nvidia1"'))
    gpus = parse_dcgm(r.text)
    assert [g.temp_c for g in gpus] == [55.0, 71.0]
    assert gpus[0].power_w == 310.0 and gpus[0].power_limit_w == 700.0  # mW -> W
    assert gpus[1].sm_clock_mhz == 1980.0 and gpus[1].ecc_dbe == 0.0 and gpus[1].xid == 0


def test_agent_reads_at_each_scrape_and_keeps_the_last_xid(agent: str, nvml: FakeNvml) -> None:
    nvml.gpus[0].temp_c = 88
    nvml.gpus[1].ecc_dbe = 1
    nvml.events += [(1, 48), (1, 79)]
    gpus = parse_dcgm(httpx.get(agent, timeout=5).text)
    assert gpus[0].temp_c == 88.0 and gpus[1].ecc_dbe == 1.0
    assert [g.xid for g in gpus] == [0, 79]  # the last code, as dcgm-exporter's gauge
    assert [g.xid for g in parse_dcgm(httpx.get(agent, timeout=5).text)] == [0, 79]


def test_agent_serves_utilization_and_framebuffer_memory(agent: str, nvml: FakeNvml) -> None:
    nvml.gpus[1].util_pct = 97
    nvml.gpus[1].memory_supported = False
    text = httpx.get(agent, timeout=5).text
    fb_free = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_FB_FREE{")]
    assert len(fb_free) == 1 and 'gpu="0"' in fb_free[0]  # GPU 1: not supported, left out
    gpus = parse_dcgm(text)
    assert [g.util_ratio for g in gpus] == [0.4, 0.97]  # percent -> 0-1
    assert gpus[0].fb_used_bytes == 70_000 * 1024 * 1024  # bytes -> MiB -> bytes
    assert gpus[0].fb_total_bytes == 81_559 * 1024 * 1024
    assert gpus[1].fb_used_bytes is None and gpus[1].fb_total_bytes is None


def test_unsupported_fields_are_left_out(agent: str, nvml: FakeNvml) -> None:
    nvml.gpus[0].ecc_dbe = None  # e.g. a GPU without ECC
    gpus = parse_dcgm(httpx.get(agent, timeout=5).text)
    assert gpus[0].ecc_dbe is None and gpus[0].temp_c == 55.0
    assert gpus[1].ecc_dbe == 0.0


@pytest.mark.parametrize(
    "error", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED]
)
def test_without_nvidia_gpus_it_exits_with_a_clear_message(
    nvml: FakeNvml, capsys: pytest.CaptureFixture[str], error: int
) -> None:
    nvml.init_error = error
    assert main(["agent", "--host", "127.0.0.1", "--port", "0"]) == EXIT_NO_GPU
    err = capsys.readouterr().err
    assert "NVML is not available" in err and "GPU host" in err


def test_zero_gpus_exits_too(nvml: FakeNvml, capsys: pytest.CaptureFixture[str]) -> None:
    nvml.gpus = []
    assert main(["agent", "--port", "0"]) == EXIT_NO_GPU
    assert "no NVIDIA GPU" in capsys.readouterr().err
    assert nvml.shutdowns == 1
