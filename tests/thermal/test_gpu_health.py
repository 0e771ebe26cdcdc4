"""The GPU health breaker end to end: new Xid errors / a double-bit ECC error seen in the
backend's DCGM telemetry make it ``unhealthy`` and run the restart hook."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tests.lifecycle.support import (
    Sim,
    admin,
    history,
    metric,
    metric_samples,
    post_admin,
    sdk,
    sdk_kwargs,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread
from tests.thermal.support import DcgmStub


def hook(path: Path) -> dict[str, object]:
    code = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')"
    return {"restart_hook": {"command": [sys.executable, "-c", code, str(path), "{backend_id}"]}}


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_xid_burst_makes_backend_unhealthy_and_runs_the_restart_hook(
    tmp_path: Path,
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea = exporters(gpus=2, temp_c=60.0, xid=13)  # an old Xid from before: not new
    eb = exporters(temp_c=60.0)
    out = tmp_path / "hook.log"
    gw = th_gateway(
        [
            {"id": "a", "url": a.url, "gpu_metrics_url": ea.url},
            {"id": "b", "url": b.url, "gpu_metrics_url": eb.url},
        ],
        lifecycle=hook(out),
    )
    ea.wait_scraped(3)
    for gpu, code in ((0, 79), (1, 48)):  # two new Xids: not yet a burst
        ea.gpus[gpu].xid = code
        ea.wait_scraped(3)
    assert admin(gw.url, "a")["state"] == "warm"
    assert admin(gw.url, "a")["gpu"]["recent_xid_errors"] == 2

    ea.gpus[0].xid = 31  # the third within the hour
    assert wait_for(lambda: admin(gw.url, "a")["state"] == "unhealthy", timeout=10)
    assert ("warm", "unhealthy", "gpu_xid") in history(gw.url, "a")
    assert wait_for(lambda: lines(out) == ["a"], timeout=10)
    # the hook wrote its line; the hold turns from gpu_fault to restarting once it exits
    assert wait_for(lambda: admin(gw.url, "a")["hold"] == "restarting", timeout=10)
    assert "Xid" in admin(gw.url, "a")["last_error"]
    m = metric_samples(gw.url)
    assert metric(m, "gateway_gpu_errors_total", backend="a", kind="xid") == 3.0
    assert metric(m, "gateway_restart_hooks_total", backend="a", result="ok") == 1.0
    before = a.chat_requests()
    client = sdk(gw.url)
    for _ in range(4):
        client.chat.completions.create(**sdk_kwargs())
    assert a.chat_requests() == before
    assert admin(gw.url, "b")["state"] == "warm"


def test_new_double_bit_ecc_error_makes_backend_unhealthy_and_held_without_hook(
    sims: Callable[..., Sim],
    exporters: Callable[..., DcgmStub],
    th_gateway: Callable[..., GatewayThread],
) -> None:
    a, b = sims("a"), sims("b")
    ea = exporters(temp_c=60.0, ecc_dbe=2.0)  # old errors: the baseline
    gw = th_gateway(
        [{"id": "a", "url": a.url, "gpu_metrics_url": ea.url}, {"id": "b", "url": b.url}]
    )
    ea.wait_scraped(3)
    assert admin(gw.url, "a")["state"] == "warm"
    ea.set(ecc_dbe=3.0)
    assert wait_for(lambda: admin(gw.url, "a")["state"] == "unhealthy", timeout=10)
    assert ("warm", "unhealthy", "gpu_ecc") in history(gw.url, "a")
    # No restart hook configured: its probes pass, yet it stays out until an operator acts.
    ea.wait_scraped(5)
    shown = admin(gw.url, "a")
    assert shown["state"] == "unhealthy" and shown["hold"] == "gpu_fault"
    m = metric_samples(gw.url)
    assert metric(m, "gateway_restart_hooks_total", backend="a", result="none") == 1.0
    assert metric(m, "gateway_gpu_errors_total", backend="a", kind="ecc_dbe") == 1.0
    # The operator replaced the GPU: undrain, and probes bring it back.
    assert post_admin(gw.url, "a", "undrain").status_code == 200
    assert wait_for(lambda: admin(gw.url, "a")["state"] == "warm", timeout=10)
