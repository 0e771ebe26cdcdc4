"""A backend's cold start measured from discovery: a real DNS server (dnsmasq) whose records
the test changes, the real gateway resolving it, simulated vLLM servers on loopback
addresses sharing one port (the pods of a headless Service).

Streams through the openai SDK keep the first pod (two sequences at once) queued, so the
autoscaler asks for more replicas. Then a new address is published before its server
listens (a pod whose process and model are still loading): the gateway finds it, probes it
in vain until the server starts, then warms it up. ``gateway_cold_start_seconds{model,
gpu_type,stage}`` shows the stages (``load``: found -> first healthy probe, at least the
time the test held the server back; ``warmup``: -> warm; ``total``), ``GET /autoscale``
plans with the measured mean, and ``gateway_autoscale_lag_seconds`` has the scale-up lag:
from the decision that asked for a replica to the new one ready, so at least as long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.lifecycle.support import (
    MODEL,
    Sim,
    metric,
    metric_samples,
    wait_for,
)
from tests.support.dnsmasq import DnsServer
from tests.support.load import StreamLoad
from tests.support.servers import GatewayThread, gateway_config

NAME = "vllm.test"
HELD_S = 1.5  # how long the new pod's server is held back after its address is published


def cold(samples: Any, stage: str, what: str = "count") -> float:
    return metric(samples, f"gateway_cold_start_seconds_{what}", model=MODEL,
                  gpu_type="unknown", stage=stage) or 0.0


def lag(samples: Any, what: str = "count") -> float:
    return metric(samples, f"gateway_autoscale_lag_seconds_{what}", model=MODEL) or 0.0


def desired(gw: GatewayThread) -> int:
    r = httpx.get(gw.url + "/autoscale", params={"model": MODEL}, timeout=5).json()
    return int(r["desired_replicas"])


def states(gw: GatewayThread) -> dict[str, str]:
    body = httpx.get(gw.url + "/admin/backends", timeout=5).json()
    return {b["id"]: b["state"] for b in body["backends"]}


def test_a_pod_found_by_dns_has_its_cold_start_measured_by_stage(
    dns_server: DnsServer, pods: Callable[..., Sim]
) -> None:
    a = pods("127.0.0.2", itl_s=0.02, max_num_seqs=2)
    dns_server.set_records([(a.host, NAME)])
    cfg = gateway_config(
        [],
        discovery={
            "source": "dns",
            "dns": {"name": NAME, "port": a.port, "interval_s": 0.2, "timeout_s": 0.5,
                    "nameservers": [dns_server.nameserver]},
            "template": {"max_num_seqs": 2},
        },
        lifecycle={"warmup_batch_shapes": [1, 2]},  # a warm-up stage with work in it
        admission={"in_flight_per_seq": 4},  # the queue forms on the backend, as vLLM's
        slo={"ttft_s": 60},  # no shedding
        autoscale={"interval_s": 0.2},
    )
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    load: StreamLoad | None = None
    try:
        a_id = f"{a.host}-{a.port}"
        assert wait_for(lambda: states(gw).get(a_id) == "warm", 20), states(gw)
        assert wait_for(lambda: cold(metric_samples(gw.url), "total") == 1, 5)
        loaded_at = time.monotonic()  # no ask can be older (a's own was met when it warmed)
        load = StreamLoad(gw.url)
        assert wait_for(lambda: desired(gw) > 1, 15)  # asks for more than the one it has
        before = metric_samples(gw.url)

        # the new pod's address is published before its server listens
        b_host = "127.0.0.3"
        b_id = f"{b_host}-{a.port}"
        dns_server.set_records([(a.host, NAME), (b_host, NAME)])
        assert wait_for(lambda: b_id in states(gw), 10), states(gw)
        found_at = time.monotonic()
        time.sleep(HELD_S)
        assert states(gw)[b_id] == "cold"  # probed in vain: nothing listens yet
        b = pods(b_host, itl_s=0.02, max_num_seqs=2)
        assert wait_for(lambda: states(gw).get(b_id) == "warm", 20), states(gw)
        warm_after = time.monotonic() - found_at
        ready_after = time.monotonic() - loaded_at
        assert b.stats()["requests_by_path"].get("/v1/completions", 0) >= 3  # warm-up ran

        assert wait_for(lambda: cold(metric_samples(gw.url), "total") == 2, 5)
        after = metric_samples(gw.url)
        for stage in ("load", "warmup", "total"):
            assert cold(after, stage) == 2, stage
        loading = cold(after, "load", "sum") - cold(before, "load", "sum")
        warmup = cold(after, "warmup", "sum") - cold(before, "warmup", "sum")
        total = cold(after, "total", "sum") - cold(before, "total", "sum")
        assert HELD_S <= loading <= warm_after + 1.0, (loading, warm_after)
        assert warmup > 0
        assert abs(total - (loading + warmup)) < 1e-6

        # one scale-up completed: asked before the pod was published, ready after its load
        assert wait_for(lambda: lag(metric_samples(gw.url)) == lag(before) + 1, 5)
        lagged = lag(metric_samples(gw.url), "sum") - lag(before, "sum")
        assert HELD_S <= lagged <= ready_after + 1.0, (lagged, ready_after)
        load.stop()
        assert load.failures == [], load.failures[:5]

        # the ahead paradigm plans with the measured mean (both pods arrived after start)
        def measured() -> bool:
            r = httpx.get(gw.url + "/autoscale", params={"model": MODEL}, timeout=5).json()
            return bool(r["cold_start_measured"]) and abs(
                r["cold_start_s"] - cold(after, "total", "sum") / 2) < 1e-2
        assert wait_for(measured, 5)
    finally:
        if load is not None:
            load.stop()
        gw.stop()
