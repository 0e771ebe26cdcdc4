"""Fleet mode drives the GPUs' clocks from one replica (issue 21; gateway/coord/clock_lease.py):
real Redis, two gateway replicas (one a subprocess that is SIGKILLed), a simulated vLLM whose
simulated GPU serves the agent's control endpoint and reverts its caps without contact.

The holder caps the idle GPU's clock (the efficiency cap: an idle backend runs at 70% of its
clock); the other replica never calls the agent, yet shows the cap (the holder's published
state). Killed, the holder's lease runs out and the other takes over within the lease TTL,
adopting the cap (the GPU's clock never jumps back up, the agent never reverts). Then the
store stops: no replica drives after the TTL, nobody contacts the agent, and the agent
reverts the cap: no GPU stays capped; requests go on being served throughout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.test_maintenance_leases import _serve_subprocess
from tests.lifecycle.support import Sim, admin, sdk, sdk_kwargs
from tests.support.redis_server import RedisServer
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config
from tests.thermal.conftest import THERMAL

TOKEN = "agent-token"
TTL_S = 2.0
REVERT_S = 4.0  # the simulated agent's revert after no contact (60 s by default): past the
# hand-over's gap in contact (the lease TTL, then a sync round)
CAP_MHZ = 0.7 * 1980  # the efficiency cap of an idle H100


def owner(gw: GatewayThread) -> float:
    return float(gw.gateway.metrics.clock_control_owner._value.get())


def caps_sent(gw: GatewayThread) -> float:
    return sum(s.value for m in gw.gateway.metrics.clock_caps.collect() for s in m.samples
               if s.name.endswith("_total"))


def locked(sim: Sim) -> Any:
    """The clock lock the simulated agent holds on GPU 0 (None: none), read in-process."""
    return sim.server.state.gpus.control.locked.get(0)


def test_one_replica_drives_a_killed_holder_is_taken_over_and_a_dead_store_leaves_no_cap(
    redis_server: RedisServer, sims: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_GATEWAY_AGENT_TOKEN", TOKEN)
    a = sims("A", gpu={"control_token": TOKEN, "tick_s": 0.1, "revert_after_s": REVERT_S})
    backend = {"id": "a", "url": a.url, "gpu_metrics_url": a.url + "/gpu/metrics",
               "gpu_control_url": a.url}
    thermal = {**THERMAL, "clocks": {"enabled": True, "interval_s": 0.2,
                                     "efficient_ratio": 0.7, "efficient_after_s": 0.0}}
    coord = {"redis_url": redis_server.url, "sync_interval_s": 0.1, "lease_ttl_s": TTL_S}
    base = gateway_config([backend], thermal=thermal,
                          coordination={**coord, "replica_id": "doomed"})
    proc, _url = _serve_subprocess(tmp_path, base.model_dump(mode="json", exclude_none=True))
    r2: GatewayThread | None = None
    try:
        # the first replica takes the lease and caps the idle GPU
        assert wait_for(lambda: locked(a) is not None, 15), "the holder never capped the GPU"
        assert locked(a)[1] == pytest.approx(CAP_MHZ, abs=1)
        r2 = GatewayThread(gateway_config([backend], thermal=thermal,
                                          coordination={**coord, "replica_id": "r2"}))
        r2.start(wait_ready=False)
        r2.wait_ready(timeout=30, routable=1)
        # r2 drives nothing, yet shows the holder's cap
        assert wait_for(lambda: (admin(r2.url, "a")["gpu"]["clock_cap"] or {}).get("max_mhz")
                        == pytest.approx(CAP_MHZ, abs=1), 10)
        time.sleep(1.0)
        assert owner(r2) == 0 and caps_sent(r2) == 0

        # the holder dies: r2 takes over within the TTL, adopting the cap
        seen: list[Any] = []
        watching = threading.Event()

        def watch() -> None:  # the agent's lock, sampled through the hand-over
            while not watching.is_set():
                seen.append(locked(a))
                time.sleep(0.02)

        sampler = threading.Thread(target=watch, daemon=True)
        sampler.start()
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        assert wait_for(lambda: owner(r2) == 1, TTL_S + 5, interval=0.05)
        took_over_s = time.monotonic() - killed
        time.sleep(1.0)
        watching.set()
        sampler.join(5)
        print(f"holder killed: r2 drives after {took_over_s:.2f} s (lease TTL {TTL_S:g} s)")
        assert took_over_s <= TTL_S + 1.0, took_over_s
        assert seen and all(s is not None and s[1] == pytest.approx(CAP_MHZ, abs=1)
                            for s in seen), "the cap was lost in the hand-over"
        assert a.server.state.gpus.control.reverts == 0
        assert caps_sent(r2) == 0  # adopted, not sent again
        assert admin(r2.url, "a")["gpu"]["clock_cap"]["max_mhz"] == pytest.approx(CAP_MHZ, abs=1)

        # the store stops: r2 stops driving after the TTL, the agent reverts the cap
        redis_server.stop()
        stopped = time.monotonic()
        client = sdk(r2.url)
        assert wait_for(lambda: locked(a) is None, TTL_S + REVERT_S + 5, interval=0.1)
        reverted_s = time.monotonic() - stopped
        print(f"store stopped: the agent reverted the cap after {reverted_s:.2f} s "
              f"(bound {TTL_S + REVERT_S:g} s)")
        assert a.server.state.gpus.control.reverts == 1
        assert owner(r2) == 0
        out = client.chat.completions.create(**sdk_kwargs(max_tokens=4))
        assert out.choices[0].message.content  # served without the store
    finally:
        if proc.poll() is None:
            proc.kill()
        if r2 is not None:
            r2.stop()


def test_a_replica_that_stops_hands_the_lease_over_at_once(
    redis_server: RedisServer, sims: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two in-process replicas with the default 10-s lease TTL: exactly one drives; the holder
    stops (a rolling restart) and gives the lease back, so the other drives within a couple
    of sync rounds, long before the TTL would have run out."""
    monkeypatch.setenv("LLM_GATEWAY_AGENT_TOKEN", TOKEN)
    a = sims("A", gpu={"control_token": TOKEN, "tick_s": 0.1})
    backend = {"id": "a", "url": a.url, "gpu_metrics_url": a.url + "/gpu/metrics",
               "gpu_control_url": a.url}
    thermal = {**THERMAL, "clocks": {"enabled": True, "interval_s": 0.2,
                                     "efficient_ratio": 0.7, "efficient_after_s": 0.0}}
    reps = []
    try:
        for rid in ("r1", "r2"):
            gw = GatewayThread(gateway_config([backend], thermal=thermal, coordination={
                "redis_url": redis_server.url, "replica_id": rid, "sync_interval_s": 0.1}))
            reps.append(gw)
            gw.start(wait_ready=False)
            gw.wait_ready(timeout=30, routable=1)
        assert wait_for(lambda: sorted(owner(gw) for gw in reps) == [0.0, 1.0], 10)
        assert wait_for(lambda: locked(a) is not None, 10)
        holder, other = reps if owner(reps[0]) == 1 else reps[::-1]
        holder.stop()
        stopped = time.monotonic()
        assert wait_for(lambda: owner(other) == 1, 10, interval=0.05)
        took_s = time.monotonic() - stopped
        print(f"holder stopped: the other drives after {took_s:.2f} s (lease TTL 10 s)")
        assert took_s < 5.0, took_s
        assert locked(a) is not None and locked(a)[1] == pytest.approx(CAP_MHZ, abs=1)
    finally:
        for gw in reps:
            gw.stop()
