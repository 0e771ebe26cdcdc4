"""Predictive batcher benchmark: batcher off vs fixed-wait vs predictive, on a simulated fleet.

Two parts, both in one run (ratios are only compared within a run):

1. **Policy matrix** (``benchmarks/batcher_des.py``: the gateway's own batcher and
   forecaster code driving the simulator's engine model in virtual time, 4 backends,
   ``max_num_seqs`` 16): bursty and diurnal workloads at 0.3x, 1x and 1.5x of the fleet's
   capacity (measured first: first tokens per second under sustained overload), 75% chat
   (priorities high/normal/low = 20/50/30%) and 25% embeddings. Modes: ``off`` (FIFO
   without the batcher: straight to the least-loaded backend, vLLM's FCFS queue),
   ``admission`` (the gateway without the batcher: at most 2x the fleet's ``max_num_seqs``
   in flight, then the admission scheduler's priority queue), ``fixed`` (batcher, full or
   timeout only) and ``predictive``. Reported: P50/P99 TTFT per priority, goodput (requests
   whose first token came within the 2 s TTFT SLO, per second), refused share, embeddings'
   upstream requests per client request, and the forecaster's MAPE vs the naive last-value
   forecast on each workload's per-second arrivals.

2. **Real HTTP** (gateway and two simulated vLLM servers as processes, aiohttp client):
   (a) streaming chat at 0.3x the fleet's capacity, Poisson arrivals shared at random
   between two gateways in front of the same simulators, batcher off and predictive (so
   both meet the same conditions): P50 TTFT of each, and the difference, per round; (b) embeddings,
   closed loop at concurrency 64, batcher off (unmerged) vs predictive with merging:
   requests/s, and upstream requests per client request (read from the simulators), in two
   settings: ``no-frontend`` (two simulators that answer embeddings at once: what is left is
   this machine's CPU, shared by client, gateway and simulators) and ``vllm-frontend`` (one
   simulator whose single API-server process costs what vLLM's does, ``--frontend-ms``:
   per HTTP request and per input, measured on vLLM 0.32.0's CPU build by
   ``benchmarks/embed_merge_real.py --costs``; the backend is the bottleneck, as it is
   for small embeddings, vllm-project/vllm#11320).

Must hold (issue 6): (a) predictive adds < 1 ms to P50 TTFT at 0.3x; (1.) at 1.5x,
high-priority P99 TTFT at least 30% lower than FIFO off; (b) merged throughput >= 2x
unmerged at concurrency 64. The verdicts are printed and stored, not the exit status.

Usage::

    python benchmarks/batcher.py                 # everything, about 5 minutes
    python benchmarks/batcher.py --skip-http     # the policy matrix only
    python benchmarks/batcher.py --skip-des --http-seconds 10

Results: ``--out`` (default ``benchmarks/results/batcher.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batcher_des as des
from loadgen import cpu_seconds
from procs import Procs, free_port

from gateway.sim.engine import EngineParams

MODEL = "bench-model"
MODES = ("off", "admission", "fixed", "predictive")


# ---- part 1: the policy matrix ----------------------------------------------------------------
def run_matrix(duration: float, seed: int) -> dict[str, Any]:
    params = EngineParams()
    cap = des.capacity(4, params)
    print(f"fleet capacity (4 backends, max_num_seqs 16): {cap:.1f} requests/s", flush=True)
    rows = []
    mape = {}
    for load in (0.3, 1.0, 1.5):
        for wl in (des.bursty(cap * load), des.diurnal(cap * load, period=duration)):
            trace = des.make_trace(wl, duration, seed)
            key = f"{wl.name}@{load}x"
            for mode in MODES:
                for r in trace:
                    r.first_token, r.rejected = None, False
                t0 = time.perf_counter()
                res = des.simulate(trace, mode, 4, params, season_s=wl.season_s)
                rows.append({"workload": wl.name, "load": load, "mode": mode, **res})
                print(
                    f"  {key:14s} {mode:10s} high p99 {fmt(res['ttft_p99_high_s'])} s, "
                    f"goodput {res['goodput_rps']:.1f}/s ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        # the forecast, scored on longer traces of the same workloads (several periods)
        for name, wl, length in (
            ("bursty", des.bursty(cap * load), 1800.0),
            (f"diurnal-{duration:g}s", des.diurnal(cap * load, period=duration), duration * 10),
            ("diurnal-600s", des.diurnal(cap * load, period=600.0), 6000.0),
        ):
            counts = des.counts_per_second(des.make_trace(wl, length, seed + 1), length)
            mape[f"{name}@{load}x"] = des.forecast_mape(counts, wl.season_s)
    return {"capacity_rps": cap, "duration_s": duration, "rows": rows, "forecast": mape}


def fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_matrix(m: dict[str, Any]) -> None:
    print("\nTTFT per priority (s), goodput (requests/s within the 2 s TTFT SLO), refused %,")
    print("embeddings upstream requests per client request")
    head = (f"{'workload':8s} {'load':>4s} {'mode':10s} {'hi p50':>7s} {'hi p99':>7s} "
            f"{'no p50':>7s} {'no p99':>7s} {'lo p50':>7s} {'lo p99':>7s} {'goodput':>7s} "
            f"{'refused':>7s} {'emb up/cl':>9s}")
    print(head)
    for r in m["rows"]:
        print(
            f"{r['workload']:8s} {r['load']:>4.1f} {r['mode']:10s} "
            f"{fmt(r['ttft_p50_high_s']):>7s} {fmt(r['ttft_p99_high_s']):>7s} "
            f"{fmt(r['ttft_p50_normal_s']):>7s} {fmt(r['ttft_p99_normal_s']):>7s} "
            f"{fmt(r['ttft_p50_low_s']):>7s} {fmt(r['ttft_p99_low_s']):>7s} "
            f"{r['goodput_rps']:>7.1f} {r['rejected_pct']:>6.1f}% "
            f"{fmt(r['emb_upstream_per_client'], '.2f'):>9s}"
        )
    print("\nforecast of the mean rate 30 s ahead, MAPE (%): Holt-Winters vs naive last value")
    for k, v in m["forecast"].items():
        print(f"  {k:20s} {v['forecast_mape_pct']:6.1f}  vs {v['naive_mape_pct']:6.1f}")


# ---- part 2: real HTTP ------------------------------------------------------------------------
# free_port and Procs: benchmarks/procs.py


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def gateway_config(
    path: Path, port: int, sims: list[int], batcher: bool, seqs: int,
    overrides: dict[str, Any] | None = None,
) -> None:
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning",
                   "graceful_shutdown_s": 1},
        "lifecycle": {"warmup_batch_shapes": [], "slow_start_s": 0, "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "batcher": {"enabled": batcher, **(overrides or {})},
        "backends": [
            {"id": f"s{i}", "url": f"http://127.0.0.1:{p}", "models": [MODEL],
             "max_num_seqs": seqs}
            for i, p in enumerate(sims)
        ],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 32, "ignore_eos": True, "stream": True}


async def ttft_run(
    urls: dict[str, str], rate: float, seconds: float, seed: int
) -> dict[str, list[float]]:
    """Poisson arrivals of streaming chat requests, each sent to one of ``urls`` (mode ->
    gateway) drawn at random, so every mode meets the same conditions; TTFT = request sent
    -> first event received, per mode."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {m: [] for m in urls}
    errors = 0

    async def one(session: aiohttp.ClientSession, mode: str) -> None:
        nonlocal errors
        url = urls[mode]
        t0 = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
            if resp.status != 200:
                errors += 1
                await resp.read()
                return
            first = None
            async for _chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
            out[mode].append(first if first is not None else math.nan)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = []
        t_end = time.perf_counter() + seconds
        nxt = time.perf_counter()
        while True:
            nxt += rng.expovariate(rate)
            if nxt >= t_end:
                break
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, rng.choice(list(urls)))))
        await asyncio.gather(*tasks)
    if errors:
        print(f"    ({errors} requests failed)")
    return out


async def embed_run(
    url: str,
    concurrency: int,
    seconds: float,
    model: str = MODEL,
    failures: dict[str, Any] | None = None,
    inputs: int = 1,
) -> tuple[int, int]:
    """Closed loop: ``concurrency`` workers each send an embeddings request of ``inputs``
    texts and, once it is answered (checked: 200 and that many vectors), the next. Returns
    (answered, failed); ``failures``, when given, gets a count and the first body per HTTP
    status that failed."""
    ok = bad = 0
    text = "a short sentence about lighthouses and the sea"
    body = {"model": model, "input": text if inputs == 1 else [text] * inputs,
            "encoding_format": "float"}

    async def worker(session: aiohttp.ClientSession, until: float) -> None:
        nonlocal ok, bad
        while time.perf_counter() < until:
            async with session.post(url + "/v1/embeddings", json=body) as resp:
                data = await resp.read()
                if resp.status == 200 and data.count(b'"index"') == inputs:
                    ok += 1
                else:
                    bad += 1
                    if failures is not None:
                        seen = failures.setdefault(str(resp.status), {"count": 0})
                        seen["count"] += 1
                        seen.setdefault("first", data[:300].decode(errors="replace"))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        until = time.perf_counter() + seconds
        await asyncio.gather(*(worker(session, until) for _ in range(concurrency)))
    return ok, bad


def cpu_by_group(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each group of processes (name -> PIDs)."""
    return {k: sum(cpu_seconds(x) for x in v) for k, v in pids.items()}


def sim_requests(ports: list[int], path: str) -> int:
    total = 0
    for p in ports:
        stats = httpx.get(f"http://127.0.0.1:{p}/sim/stats").json()
        total += int(stats["requests_by_path"].get(path, 0))
    return total


def embeddings_cell(
    gateway: Any, mode: str, ports: list[int], sims: list[Any], seconds: float
) -> dict[str, Any]:
    """One closed-loop embeddings cell at concurrency 64 against a fresh gateway: requests/s,
    upstream requests per client request, CPU ms per request of gateway, sims and client."""
    g, url = gateway(mode == "predictive")
    try:
        asyncio.run(embed_run(url, 64, 2.0))
        before = sim_requests(ports, "/v1/embeddings")
        pids = {"gateway": [g.pid], "sims": [x.pid for x in sims], "client": [os.getpid()]}
        cpu0 = cpu_by_group(pids)
        ok, bad = asyncio.run(embed_run(url, 64, seconds))
        cpu1 = cpu_by_group(pids)
        upstream = sim_requests(ports, "/v1/embeddings") - before
        metrics = httpx.get(url + "/metrics").text
    finally:
        g.send_signal(signal.SIGTERM)
        g.wait(10)
    n = max(1, ok)
    cpu_ms = {k: 1000 * (cpu1[k] - cpu0[k]) / n for k in pids}
    print(f"    {mode:10s} {ok / seconds:8.1f} requests/s, {bad} failed, upstream per client "
          f"request {upstream / max(1, ok + bad):.3f}; CPU ms per request: "
          + ", ".join(f"{k} {v:.3f}" for k, v in cpu_ms.items()), flush=True)
    return {
        "rps": ok / seconds,
        "failed": bad,
        "upstream_per_client": upstream / max(1, ok + bad),
        "cpu_ms_per_request": cpu_ms,
        "batch_dispatches": [
            ln for ln in metrics.splitlines() if ln.startswith("gateway_batch_dispatches_total")
        ],
    }


# vLLM's API-server CPU per embeddings HTTP request and per input (ms): vLLM 0.32.0 CPU
# build, tiny-llama, `python benchmarks/embed_merge_real.py --costs --backend-cpus 1`
# (1 and 32 inputs per request at concurrency 8, straight to vLLM; 2026-11-30: 1.083 and
# 0.503 ms; its engine core costs less in both shapes, 1.001 and 0.428 ms, so it is not
# the bottleneck and is not modelled).
VLLM_FRONTEND_MS = (1.08, 0.50)


def run_http(
    seconds: float, rounds: int, seed: int, parts: str = "ab",
    frontend_ms: tuple[float, float] = VLLM_FRONTEND_MS,
    batcher_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="bench-batcher-"))
    procs = Procs(logdir)
    py = sys.executable
    seqs = 8
    params = EngineParams(max_num_seqs=seqs)
    # capacity of 2 backends for this request shape (32 tokens at a full batch's step time,
    # plus one prefill): an estimate, only used to place 0.3x
    per_req = 32 * params.decode_time_s(seqs) + params.prefill_time_s(20)
    cap = 2 * seqs / per_req
    out: dict[str, Any] = {"capacity_rps": cap, "logs": str(logdir)}
    try:
        ports: list[int] = []
        sims: list[subprocess.Popen[bytes]] = []

        def start_sims(frontend: tuple[float, float] = (0.0, 0.0), n: int = 2) -> None:
            for sp in sims:
                procs.stop(sp)
            sims.clear()
            ports[:] = [free_port() for _ in range(n)]
            for i, p in enumerate(ports):
                sims.append(procs.start(f"sim{i}", [
                    py, "-m", "gateway.cli", "sim", "--port", str(p), "--model", MODEL,
                    "--max-num-seqs", str(seqs), "--log-level", "warning",
                    "--request-overhead", str(frontend[0] / 1000),
                    "--input-overhead", str(frontend[1] / 1000)]))
            for p in ports:
                wait_http(f"http://127.0.0.1:{p}/health")

        start_sims()

        def gateway(batcher: bool) -> tuple[subprocess.Popen[bytes], str]:
            port = free_port()
            cfgp = logdir / f"gateway-{'on' if batcher else 'off'}.yaml"
            gateway_config(cfgp, port, ports, batcher, seqs, batcher_overrides)
            g = procs.start(f"gateway-{'on' if batcher else 'off'}",
                            [py, "-m", "gateway.cli", "serve", "-c", str(cfgp)])
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/ready/fleet")  # a backend routable
            return g, url

        # (a) TTFT at 0.3x: both gateways up, each request to one of them at random
        rate = 0.3 * cap
        if "a" in parts:
            print(f"\nreal HTTP (a): streaming chat at 0.3x = {rate:.1f} requests/s, shared at "
                  f"random between a gateway without and one with the batcher, {rounds} x "
                  f"{seconds:g} s", flush=True)
            g_off, url_off = gateway(False)
            g_on, url_on = gateway(True)
            urls = {"off": url_off, "predictive": url_on}
            asyncio.run(ttft_run(urls, rate, 3.0, seed + 99))  # warm the pools
            p50s: dict[str, list[float]] = {"off": [], "predictive": []}
            for rnd in range(rounds):
                vals = asyncio.run(ttft_run(urls, rate, seconds, seed + rnd))
                for mode in urls:
                    p50 = statistics.median(vals[mode]) * 1000
                    p50s[mode].append(p50)
                    print(f"  round {rnd + 1} {mode:10s} P50 TTFT {p50:7.2f} ms (P99 "
                          f"{des.pct(vals[mode], 0.99) * 1000:7.2f} ms, n={len(vals[mode])})",
                          flush=True)
            waits = [ln for ln in httpx.get(url_on + "/metrics").text.splitlines()
                     if ln.startswith(("gateway_batch_dispatches_total",
                                       "gateway_batch_wait_seconds_sum",
                                       "gateway_batch_wait_seconds_count"))]
            print("  predictive gateway: " + "; ".join(waits), flush=True)
            procs.stop(g_off)
            procs.stop(g_on)
            diffs = [b - a for a, b in zip(p50s["off"], p50s["predictive"], strict=True)]
            out["ttft_low_load"] = {"rate_rps": rate, "p50_ms": p50s, "added_p50_ms": diffs,
                                    "added_p50_ms_median": statistics.median(diffs),
                                    "batcher_metrics": waits}
        # (b) embeddings at concurrency 64
        if "b" in parts:
            print(f"\nreal HTTP (b): embeddings, closed loop, concurrency 64, {seconds:g} s",
                  flush=True)
            embs: dict[str, Any] = {}
            for name, frontend, n in (("no-frontend", (0.0, 0.0), 2),
                                      ("vllm-frontend", frontend_ms, 1)):
                start_sims(frontend, n)
                print(f"  {name}: {n} simulator(s), API-server {frontend[0]:g} ms per request "
                      f"+ {frontend[1]:g} ms per input", flush=True)
                emb: dict[str, Any] = {"simulators": n, "frontend_ms": list(frontend)}
                for mode in ("off", "predictive"):
                    emb[mode] = embeddings_cell(gateway, mode, ports, sims, seconds)
                emb["ratio"] = emb["predictive"]["rps"] / emb["off"]["rps"]
                print(f"  {name}: merged / unmerged {emb['ratio']:.2f}x", flush=True)
                embs[name] = emb
            out["embeddings_c64"] = embs
    finally:
        procs.stop_all()
    return out


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    v: dict[str, Any] = {}
    m = result.get("matrix")
    if m:
        checks = []
        for wl in ("bursty", "diurnal"):
            rows = {r["mode"]: r for r in m["rows"] if r["workload"] == wl and r["load"] == 1.5}
            off, pred = rows["off"]["ttft_p99_high_s"], rows["predictive"]["ttft_p99_high_s"]
            cut = 1 - pred / off
            checks.append({"workload": wl, "off_s": off, "predictive_s": pred,
                           "reduction_pct": 100 * cut, "ok": cut >= 0.30})
        v["high_p99_at_1.5x"] = checks
    h = result.get("http") or {}
    if "ttft_low_load" in h:
        added = h["ttft_low_load"]["added_p50_ms_median"]
        v["added_p50_ttft_at_0.3x_ms"] = {"value": added, "ok": added < 1.0}
    for key, emb in h.get("embeddings_c64", {}).items():
        ratio = emb["ratio"]
        v[f"embeddings_merge_ratio_c64_{key}"] = {"value": ratio, "ok": ratio >= 2.0}
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=150.0, help="simulated seconds per cell")
    ap.add_argument("--http-seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the TTFT test (a)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--skip-des", action="store_true")
    ap.add_argument("--http-parts", default="ab", help="a: TTFT at 0.3x, b: embeddings")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--batcher", default="{}",
                    help="JSON merged into the real-HTTP gateways' batcher section (the "
                    "matrix uses the defaults)")
    ap.add_argument("--frontend-ms", default=",".join(f"{x:g}" for x in VLLM_FRONTEND_MS),
                    help="vLLM API-server ms per embeddings request and per input (the "
                    "vllm-frontend cell of part b), from embed_merge_real.py --costs")
    ap.add_argument("--out", default="benchmarks/results/batcher.json")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"argv": sys.argv, "cpus": os.cpu_count()}
    if not args.skip_des:
        result["matrix"] = run_matrix(args.duration, args.seed)
        print_matrix(result["matrix"])
    if not args.skip_http:
        a, b = (float(x) for x in args.frontend_ms.split(","))
        result["http"] = run_http(args.http_seconds, args.rounds, args.seed, args.http_parts,
                                  (a, b), json.loads(args.batcher))
    result["verdicts"] = verdicts(result)
    print("\nmust hold:")
    print(json.dumps(result["verdicts"], indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
