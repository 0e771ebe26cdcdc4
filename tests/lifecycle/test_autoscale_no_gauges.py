"""A backend whose ``/metrics`` lacks vLLM's load gauges (another OpenAI-compatible server,
an exporter that broke) still shows its load to the autoscaler: the real gateway under
uvicorn, a scripted backend (it stands in for a server without ``vllm:num_requests_*``:
its ``/metrics`` answers 404) holding streams open, the openai SDK as client.

Before this was fixed the fast paradigm read such a backend's load as nothing (no sample:
0 requests) and the last sample of one whose scrapes began to fail stayed its load for
ever; ``desired_replicas`` stayed at 1 while six streams queued on a replica of two
sequences. Now a ready backend without a fresh sample (``telemetry.stale_after_s``) counts
the requests this gateway has in flight there."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from tests.lifecycle.support import sdk, wait_for
from tests.support.scripted import Conn, Received, ScriptedBackend, chunk_obj, default_script
from tests.support.servers import GatewayThread, gateway_config

STREAMS = 6
release = threading.Event()


async def no_gauges(req: Received, conn: Conn) -> None:
    if req.path == "/metrics":  # a server without vLLM's gauges
        await conn.send_response(404, b"not found")
    else:
        await default_script(req, conn)


async def held_stream(req: Received, conn: Conn) -> None:
    await conn.start_stream()
    await conn.event(chunk_obj(role="assistant", content=""))
    while not release.is_set() and not conn.peer_closed.is_set():
        await asyncio.sleep(0.05)
    await conn.event(chunk_obj(finish="stop"))
    await conn.done()


def answer(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/autoscale", params={"model": "m1"}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_backend_without_load_gauges_counts_its_requests_in_flight() -> None:
    release.clear()
    backend = ScriptedBackend(held_stream, control=no_gauges)
    backend.start()
    cfg = gateway_config(
        [{"id": "a", "url": backend.url, "max_num_seqs": 2}],
        admission={"in_flight_per_seq": 4}, slo={"ttft_s": 60}, forecast={"enabled": False},
        autoscale={"interval_s": 0.2, "scale_down_cooldown_s": 1},
    )
    gw = GatewayThread(cfg)
    gw.start()
    failures: list[str] = []

    def one() -> None:
        try:
            list(sdk(gw.url).chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], stream=True))
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(STREAMS)]
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: len(backend.data_requests) == STREAMS, 15)
        # 6 requests on one replica of 2 sequences, target 0.85 x 2: ceil(6 / 1.7) = 4
        assert wait_for(lambda: answer(gw)["paradigms"]["fast"] == 4, 10), answer(gw)
        assert answer(gw)["desired_replicas"] == 4
        release.set()
        for t in threads:
            t.join(15)
        assert failures == [], failures
        # the streams are done: the count falls after the cooldown, nothing sticks
        assert wait_for(lambda: answer(gw)["desired_replicas"] == 1, 10), answer(gw)
    finally:
        release.set()
        gw.stop()
        backend.stop()
