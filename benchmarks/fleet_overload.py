"""Fleet overload benchmark (issue 14, item 5): the overload benchmark's fleet at 3x its
capacity, through three gateway replicas sharing one Redis, clients spread over them.

Same settings as ``benchmarks/overload.py`` (three ``llm-gateway sim`` processes,
``--max-num-seqs`` 4 each, ``--speed`` 0.25, 24-token streams, priorities high/normal/low
0.2/0.5/0.3, TTFT SLO 2 s, admission on with its defaults), plus a ``redis-server`` and
``--replicas`` gateway processes (``llm-gateway serve``, ``coordination.redis_url`` set).

1. **Capacity**: a closed loop of ``backends x max_num_seqs`` streams through the replicas
   (round-robin) for ``--capacity-s`` seconds: requests/s the fleet completes.
2. **Overload**, once with capacity shares on (the default in fleet mode) and once with
   ``coordination.capacity_shares: false`` (each replica applies the whole bound, as before
   issue 14): Poisson arrivals at ``--factor`` x capacity for ``--duration`` seconds, each
   request sent to the next replica in turn. Meanwhile the simulators' own ``/metrics``
   (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, summed over the
   backends) are sampled every 100 ms.

Must hold (issue 14): with shares on, the backends' total in flight within 10% of what one
replica allows (``backends x max_num_seqs x admission.in_flight_per_seq``; the P99 of the
samples from 5 s in); high-priority P99 TTFT within the SLO.

Run: ``python benchmarks/fleet_overload.py`` (about 2 minutes). Writes
``benchmarks/results/fleet_overload.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload import (
    PRIOS,
    REPO,
    Result,
    cli,
    gateway_config,
    one,
    percentile,
    print_table,
    reset_sims,
    sim_chat_counts,
    summarise,
    wait_http,
)
from procs import Procs, free_port

# the simulators' gauges of requests they hold (vLLM's names; not ..._waiting_by_reason)
IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def fleet_config(urls: list[str], port: int, redis_url: str, replica: str, shares: bool,
                 args: argparse.Namespace) -> str:
    """The overload benchmark's gateway config with fleet mode on."""
    path = gateway_config(urls, port, True, args)
    cfg = yaml.safe_load(Path(path).read_text())
    cfg["coordination"] = {"redis_url": redis_url, "replica_id": replica,
                           "capacity_shares": shares}
    Path(path).write_text(yaml.safe_dump(cfg))
    return path


async def sample_in_flight(urls: list[str], stop: asyncio.Event, out: list[tuple[float, int]]
                           ) -> None:
    """Every 100 ms: running + waiting summed over the simulators (their ``/metrics``)."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t = time.monotonic()
            total = 0
            for u in urls:
                async with s.get(u + "/metrics") as r:
                    text = await r.text()
                for line in text.splitlines():
                    if line.split("{", 1)[0] in IN_FLIGHT:
                        total += int(float(line.rsplit(" ", 1)[1]))
            out.append((t, total))
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t)))


async def capacity_rps(gw_urls: list[str], args: argparse.Namespace, slots: int) -> float:
    """Requests/s the fleet completes with ``slots`` concurrent streams over the replicas."""
    done = 0
    stop_at = time.monotonic() + args.capacity_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker(i: int) -> None:
            nonlocal done
            k = 0
            while time.monotonic() < stop_at:
                r = await one(session, gw_urls[i % len(gw_urls)], "high", f"cap-{i}-{k}", args)
                k += 1
                if r.status == 200 and r.done and time.monotonic() <= stop_at:
                    done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(slots)))
        return done / (time.monotonic() - t0)


async def overload(gw_urls: list[str], rate: float, args: argparse.Namespace) -> list[Result]:
    """Poisson arrivals at ``rate`` for ``--duration`` s, each to the next replica."""
    rng = random.Random(args.seed)
    results: list[Result] = []
    tasks: list[asyncio.Task[Any]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:

        async def client(url: str, prio: str, rid: str) -> None:
            results.append(await one(session, url, prio, rid, args))

        t0 = time.monotonic()
        t = 0.0
        k = 0
        weights = [float(x) for x in args.mix.split(",")]
        while t < args.duration:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            prio = rng.choices(PRIOS, weights)[0]
            tasks.append(asyncio.create_task(client(gw_urls[k % len(gw_urls)], prio, f"ov-{k}")))
            k += 1
        await asyncio.gather(*tasks)
    return results


async def run_one(shares: bool, urls: list[str], redis_url: str, procs: Procs,
                  args: argparse.Namespace, capacity: float | None
                  ) -> tuple[dict[str, Any], float]:
    label = "shares on" if shares else "shares off"
    gws, paths, gw_urls = [], [], []
    for i in range(args.replicas):
        port = free_port()
        path = fleet_config(urls, port, redis_url, f"r{i + 1}", shares, args)
        paths.append(path)
        gws.append(procs.start(f"gateway-{'on' if shares else 'off'}-r{i + 1}",
                               cli("serve", "--config", path)))
        gw_urls.append(f"http://127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession() as s:
            for u in gw_urls:
                await wait_http(s, u + "/ready/fleet")  # a backend routable
        await asyncio.sleep(1.0)  # a few sync rounds: every replica sees the others
        if capacity is None:
            capacity = await capacity_rps(gw_urls, args, len(urls) * args.max_num_seqs)
            print(f"capacity: {capacity:.2f} requests/s", flush=True)
            await asyncio.sleep(2)
        await reset_sims(urls)
        rate = capacity * args.factor
        print(f"overload through {args.replicas} replicas, {label}: {rate:.1f} requests/s "
              f"for {args.duration:g} s ...", flush=True)
        stop = asyncio.Event()
        samples: list[tuple[float, int]] = []
        sampler = asyncio.create_task(sample_in_flight(urls, stop, samples))
        t0 = time.monotonic()
        results = await overload(gw_urls, rate, args)
        stop.set()
        await sampler
        received, ids = await sim_chat_counts(urls)
        summary = summarise(results, received, ids, args.slo_ttft, capacity, rate)
        steady = [n for t, n in samples if t0 + 5 <= t <= t0 + args.duration]
        one_replica = len(urls) * args.max_num_seqs * (args.in_flight_per_seq or 1.0)
        summary["gateway"] = {"rejections": "-", "queue_wait_mean_s": "-"}
        summary["backend_in_flight"] = {
            "one_replica_allows": one_replica,
            "mean": round(sum(steady) / max(1, len(steady)), 2),
            "p99": percentile([float(n) for n in steady], 0.99),
            "max": max(steady, default=None),
            "samples": len(steady),
        }
        return summary, capacity
    finally:
        for p in gws:
            procs.stop(p)
        for path in paths:
            os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--backends", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--speed", type=float, default=0.25, help="simulator speed multiplier")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="overload seconds per run")
    ap.add_argument("--capacity-s", type=float, default=10.0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, s")
    ap.add_argument("--mix", default="0.2,0.5,0.3", help="high,normal,low shares")
    ap.add_argument("--in-flight-per-seq", type=float, default=None,
                    help="admission.in_flight_per_seq (default: the gateway's, 1.0)")
    ap.add_argument("--only-shares", action="store_true", help="skip the shares-off run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fleet_overload.json"))
    args = ap.parse_args(argv)
    redis_exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if redis_exe is None:
        print("redis-server is not installed (apt-get install redis-server)")
        return 2

    logdir = Path(tempfile.mkdtemp(prefix="fleet-overload-"))
    procs = Procs(logdir, cwd=REPO)
    print(f"logs: {logdir}")
    urls: list[str] = []
    try:
        rport = free_port()
        procs.start("redis", [redis_exe, "--port", str(rport), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(logdir)])
        redis_url = f"redis://127.0.0.1:{rport}/0"
        for i in range(args.backends):
            port = free_port()
            procs.start(f"sim{i}", cli(
                "sim", "--port", str(port), "--model", "sim-model", "--seed", str(i + 1),
                "--max-num-seqs", str(args.max_num_seqs), "--speed", str(args.speed),
                "--log-level", "warning"))
            urls.append(f"http://127.0.0.1:{port}")

        async def go() -> dict[str, dict[str, Any]]:
            async with aiohttp.ClientSession() as s:
                for u in urls:
                    await wait_http(s, u + "/health")
            on, capacity = await run_one(True, urls, redis_url, procs, args, None)
            runs = {"shares on": on}
            if not args.only_shares:
                await asyncio.sleep(3)
                runs["shares off"], _ = await run_one(False, urls, redis_url, procs, args,
                                                      capacity)
            return runs

        runs = asyncio.run(go())
    finally:
        procs.stop_all()
    print_table(runs)
    names = list(runs)
    for label in ("one_replica_allows", "mean", "p99", "max"):
        print(f"{'backends in flight ' + label:34}"
              + "".join(f"{runs[n]['backend_in_flight'][label]!s:>22}" for n in names))
    on = runs["shares on"]
    bif = on["backend_in_flight"]
    high = on["ttft_p99_by_priority_s"]["high"]
    checks = {
        "backends' total in flight within 10% of one replica's bound":
            bif["p99"] is not None and bif["p99"] <= 1.1 * bif["one_replica_allows"],
        "high-priority P99 TTFT within SLO": high is not None and high <= args.slo_ttft,
        "no request lost or answered twice": on["lost"] == 0 and on["answered_twice"] == 0,
    }
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "fleet_overload", "params": vars(args),
                               "runs": runs, "checks": checks}, indent=2))
    print(f"\nwritten: {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
