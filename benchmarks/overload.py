"""Overload benchmark (issue 4): a simulated fleet at 3x its capacity, admission on vs off.

What it runs (every process its own, so the load generator does not steal the gateway's
event loop): three simulated vLLM servers (``llm-gateway sim``, ``--max-num-seqs`` each,
slowed by ``--speed``), the gateway (``llm-gateway serve`` on a generated config), and this
process as an open-loop client (aiohttp, Poisson arrivals).

1. **Capacity**: a closed loop of ``backends x max_num_seqs`` concurrent streams for
   ``--capacity-s`` seconds measures what the fleet completes per second (requests/s).
2. **Overload**, once with admission on (the defaults: in-flight bound from
   ``max_num_seqs``, priority queue, predicted-wait bound, saturation shedding) and once
   with ``admission.enabled: false``: Poisson arrivals at ``--factor`` x capacity for
   ``--duration`` seconds, every request a stream of ``--max-tokens`` tokens
   (``ignore_eos``), priority high/normal/low in the ``--mix`` shares (``x-priority``).
   Each request is recorded: status, TTFT (first content event), ``retry-after``.
   One rejected request in ``--probe-every`` becomes a *prober*: it retries every 0.25 s
   until admitted (at most 60 s), which gives the real time until capacity freed for it,
   to set against the ``retry-after`` it was told (probers' own attempts are not counted
   as client requests).
3. Report per run: admitted P50/P99 TTFT overall and per priority vs the TTFT SLO, the
   share answered 429, whether every 429 carried ``retry-after``, advertised vs real
   time until capacity, backend requests per client request (amplification, from the
   simulators' own counters), lost requests (transport errors, no status) and requests
   answered more than once (impossible over HTTP/1.1, counted anyway from the request ids
   the backends saw).

Run: ``python benchmarks/overload.py`` (about 2-3 minutes; ``--duration`` scales it).
Must hold (issue 4): with admission on, high-priority P99 TTFT within the SLO; every
rejection carries Retry-After; no request lost or answered twice. Writes
``benchmarks/results/overload.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Procs, free_port  # noqa: E402

MODEL = "sim-model"
PRIOS = ("high", "normal", "low")
# a chunk whose delta carries text: the first token (the role chunk's "content" is empty)
FIRST_TOKEN = re.compile(rb'"content":\s*"[^"]')


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by nearest rank; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


# ---- processes -------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    """The ``llm-gateway`` command line of this interpreter."""
    return [sys.executable, "-c", "from gateway.cli import main; raise SystemExit(main())",
            *args]


async def wait_http(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def gateway_config(urls: list[str], port: int, admission: bool, args: argparse.Namespace) -> str:
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "slo": {"ttft_s": args.slo_ttft},
        "admission": {"enabled": admission, **(
            {"in_flight_per_seq": args.in_flight_per_seq} if args.in_flight_per_seq else {})},
        "lifecycle": {
            "warmup_batch_shapes": [1],
            "slow_start_s": 0,
            "short": {"every_s": 0},
            "medium": {"every_s": 0, "every_requests": 0},
            "long": {"every_s": 0},
        },
        "calibration": {"enabled": False},
        "auth": {"anonymous_max_priority": "high"},  # the mix's x-priority: high is granted
        "backends": [
            {"id": f"sim{i}", "url": u, "max_num_seqs": args.max_num_seqs}
            for i, u in enumerate(urls)
        ],
    }
    fd, path = tempfile.mkstemp(prefix="overload-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


# ---- one request ---------------------------------------------------------------------------
@dataclass
class Result:
    prio: str
    start: float
    status: int = 0
    ttft_s: float | None = None
    retry_after: str | None = None
    retry_after_ms: str | None = None
    error: str | None = None
    done: bool = False
    probe_wait_s: float | None = None  # prober: real time until admitted
    probe_advertised_s: float | None = None


def body(args: argparse.Namespace, rid: str) -> bytes:
    return json.dumps({
        "model": MODEL,
        "messages": [{"role": "user", "content": f"overload {rid}"}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }).encode()


async def one(
    session: aiohttp.ClientSession, url: str, prio: str, rid: str, args: argparse.Namespace
) -> Result:
    res = Result(prio, time.monotonic())
    headers = {"content-type": "application/json", "x-priority": prio, "x-request-id": rid}
    try:
        async with session.post(url + "/v1/chat/completions", data=body(args, rid),
                                headers=headers) as r:
            res.status = r.status
            res.retry_after = r.headers.get("retry-after")
            res.retry_after_ms = r.headers.get("retry-after-ms")
            if r.status != 200:
                await r.read()
                return res
            buf = b""
            async for chunk in r.content.iter_any():
                if res.ttft_s is None and FIRST_TOKEN.search(buf[-32:] + chunk):
                    res.ttft_s = time.monotonic() - res.start
                buf = (buf + chunk)[-64:]
            res.done = buf.endswith(b"data: [DONE]\n\n")
    except (aiohttp.ClientError, TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def prober(
    session: aiohttp.ClientSession, url: str, first: Result, rid: str, args: argparse.Namespace
) -> None:
    """Retry a rejected request every 0.25 s until admitted: the real time until capacity."""
    advertised = float(first.retry_after_ms or 0) / 1000 or float(first.retry_after or 0)
    first.probe_advertised_s = advertised
    t0 = first.start
    n = 0
    while time.monotonic() - t0 < 60:
        await asyncio.sleep(0.25)
        n += 1
        r = await one(session, url, first.prio, f"{rid}-p{n}", args)
        if r.status == 200:
            first.probe_wait_s = r.start - t0
            return


# ---- phases ------------------------------------------------------------------------------
async def measure_capacity(url: str, args: argparse.Namespace, slots: int) -> float:
    """Requests/s the fleet completes with ``slots`` concurrent streams (closed loop)."""
    done = 0
    stop_at = time.monotonic() + args.capacity_s
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker(i: int) -> None:
            nonlocal done
            k = 0
            while time.monotonic() < stop_at:
                r = await one(session, url, "high", f"cap-{i}-{k}", args)
                k += 1
                if r.status == 200 and r.done and time.monotonic() <= stop_at:
                    done += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(slots)))
        return done / (time.monotonic() - t0)


async def overload(url: str, rate: float, args: argparse.Namespace) -> list[Result]:
    rng = random.Random(args.seed)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    results: list[Result] = []
    tasks: list[asyncio.Task[Any]] = []
    probes: list[asyncio.Task[Any]] = []
    rejected = 0
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def client(prio: str, rid: str) -> None:
            nonlocal rejected
            r = await one(session, url, prio, rid, args)
            results.append(r)
            if r.status == 429:
                rejected += 1
                if rejected % args.probe_every == 0:
                    probes.append(asyncio.create_task(prober(session, url, r, rid, args)))

        t0 = time.monotonic()
        t = 0.0
        k = 0
        weights = [float(x) for x in args.mix.split(",")]
        while t < args.duration:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            prio = rng.choices(PRIOS, weights)[0]
            tasks.append(asyncio.create_task(client(prio, f"ov-{k}")))
            k += 1
        await asyncio.gather(*tasks)
        await asyncio.gather(*probes)
    return results


async def sim_chat_counts(urls: list[str]) -> tuple[int, dict[str, int]]:
    """Chat requests the simulators received (their own counters) and the ``ov-`` request
    ids among their recent requests (to spot a request sent twice)."""
    total = 0
    ids: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.get(u + "/sim/stats") as r:
                st = await r.json()
            total += int(st["requests_by_path"].get("/v1/chat/completions", 0))
            for rq in st["recent_requests"]:
                rid = rq["headers"].get("x-request-id", "")
                if rid.startswith("ov-") and "-p" not in rid:
                    ids[rid] = ids.get(rid, 0) + 1
    return total, ids


async def gateway_metrics(url: str) -> dict[str, Any]:
    """From the gateway's ``/metrics``: admission rejections by layer and priority, mean
    queue wait by priority (s), answers by status."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, Any] = {"rejections": {}, "queue_wait_mean_s": {}, "statuses": {}}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            lb = smp.labels
            if smp.name == "gateway_admission_rejections_total" and smp.value:
                out["rejections"][f"{lb['layer']}/{lb['priority']}"] = int(smp.value)
            elif smp.name == "gateway_admission_queue_wait_seconds_sum":
                sums[lb["priority"]] = smp.value
            elif smp.name == "gateway_admission_queue_wait_seconds_count":
                counts[lb["priority"]] = smp.value
            elif smp.name == "gateway_requests_total" and smp.value:
                key = str(lb.get("status", lb.get("code", "?")))
                out["statuses"][key] = out["statuses"].get(key, 0) + int(smp.value)
    out["queue_wait_mean_s"] = {p: round(sums[p] / counts[p], 3)
                                for p in sums if counts.get(p)}
    return out


async def reset_sims(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for u in urls:
            async with s.delete(u + "/sim/stats"):
                pass


def summarise(results: list[Result], received: int, ids: dict[str, int], slo: float,
              capacity: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    rej = [r for r in results if r.status == 429]
    lost = [r for r in results if r.status == 0 or (r.status == 200 and not r.done)]
    other = [r for r in results if r.status not in (0, 200, 429)]
    ttft = {p: [r.ttft_s for r in ok if r.prio == p and r.ttft_s is not None] for p in PRIOS}
    every = [t for v in ttft.values() for t in v]
    probes = [r for r in rej if r.probe_wait_s is not None]
    return {
        "offered_rps": round(rate, 2),
        "capacity_rps": round(capacity, 2),
        "requests": len(results),
        "admitted": len(ok),
        "rejected_429": len(rej),
        "share_429": round(len(rej) / max(1, len(results)), 3),
        "other_status": {str(s): sum(1 for r in other if r.status == s)
                         for s in sorted({r.status for r in other})},
        "lost": len(lost),
        "answered_twice": sum(1 for n in ids.values() if n > 1),
        "every_429_has_retry_after": all(r.retry_after and r.retry_after_ms for r in rej),
        "ttft_slo_s": slo,
        "ttft_p50_s": percentile(every, 0.5),
        "ttft_p99_s": percentile(every, 0.99),
        "ttft_p99_by_priority_s": {p: percentile(ttft[p], 0.99) for p in PRIOS},
        "ttft_p50_by_priority_s": {p: percentile(ttft[p], 0.5) for p in PRIOS},
        "admitted_by_priority": {p: sum(1 for r in ok if r.prio == p) for p in PRIOS},
        "retry_after_s": {
            "advertised_p50": percentile([float(r.retry_after or 0) for r in rej], 0.5),
            "advertised_max": max((float(r.retry_after or 0) for r in rej), default=None),
            "probes": len(probes),
            "probe_advertised_p50": percentile([r.probe_advertised_s or 0 for r in probes], 0.5),
            "probe_real_wait_p50": percentile([r.probe_wait_s or 0 for r in probes], 0.5),
            "probe_real_wait_p90": percentile([r.probe_wait_s or 0 for r in probes], 0.9),
            "probes_admitted_by_advertised_time": sum(
                1 for r in probes if (r.probe_wait_s or 0) <= (r.probe_advertised_s or 0) + 0.3
            ),
            "by_priority": {
                p: [(round(r.probe_advertised_s or 0, 2), round(r.probe_wait_s or 0, 2))
                    for r in probes if r.prio == p]
                for p in PRIOS
            },
            "unadmitted_probes": sum(1 for r in rej if r.probe_advertised_s is not None
                                     and r.probe_wait_s is None),
        },
        "backend_requests": received,
        "amplification": round(received / max(1, len(ok) + len(other)), 3),
    }


async def run_one(admission: bool, urls: list[str], procs: Procs, args: argparse.Namespace,
                  capacity: float | None) -> tuple[dict[str, Any], float]:
    port = free_port()
    path = gateway_config(urls, port, admission, args)
    gw = procs.start(f"gateway-{'on' if admission else 'off'}", cli("serve", "--config", path))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            await wait_http(s, url + "/ready/fleet")  # a backend routable
        if capacity is None:
            capacity = await measure_capacity(url, args, len(urls) * args.max_num_seqs)
            print(f"capacity: {capacity:.2f} requests/s "
                  f"({len(urls)} backends x {args.max_num_seqs} seqs, "
                  f"{args.max_tokens} tokens, speed {args.speed})", flush=True)
            await asyncio.sleep(2)
        await reset_sims(urls)
        rate = capacity * args.factor
        print(f"overload, admission {'on' if admission else 'off'}: {rate:.1f} requests/s "
              f"for {args.duration:g} s ...", flush=True)
        results = await overload(url, rate, args)
        gw_metrics = await gateway_metrics(url)
        received, ids = await sim_chat_counts(urls)
        # probers' attempts that reached a backend are not client requests
        received -= sum(1 for r in results if r.probe_wait_s is not None)
        summary = summarise(results, received, ids, args.slo_ttft, capacity, rate)
        summary["gateway"] = gw_metrics
        return summary, capacity
    finally:
        procs.stop(gw)
        os.unlink(path)


def print_table(runs: dict[str, dict[str, Any]]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    rows = [
        ("offered / capacity (req/s)", lambda s: f"{s['offered_rps']} / {s['capacity_rps']}"),
        ("requests", lambda s: s["requests"]),
        ("admitted", lambda s: s["admitted"]),
        ("share answered 429", lambda s: s["share_429"]),
        ("every 429 has Retry-After", lambda s: s["every_429_has_retry_after"]),
        ("lost / answered twice", lambda s: f"{s['lost']} / {s['answered_twice']}"),
        ("admitted P50 TTFT (s)", lambda s: f(s["ttft_p50_s"])),
        ("admitted P99 TTFT (s)", lambda s: f(s["ttft_p99_s"])),
        ("  high P99 TTFT (s)", lambda s: f(s["ttft_p99_by_priority_s"]["high"])),
        ("  normal P99 TTFT (s)", lambda s: f(s["ttft_p99_by_priority_s"]["normal"])),
        ("  low P99 TTFT (s)", lambda s: f(s["ttft_p99_by_priority_s"]["low"])),
        ("TTFT SLO (s)", lambda s: s["ttft_slo_s"]),
        ("Retry-After advertised P50 (s)", lambda s: f(s["retry_after_s"]["advertised_p50"])),
        ("probes: advertised P50 (s)", lambda s: f(s["retry_after_s"]["probe_advertised_p50"])),
        ("probes: real wait P50 (s)", lambda s: f(s["retry_after_s"]["probe_real_wait_p50"])),
        ("probes admitted by advertised", lambda s: (
            f"{s['retry_after_s']['probes_admitted_by_advertised_time']}"
            f"/{s['retry_after_s']['probes']}")),
        ("probes (advertised, real) high", lambda s: s["retry_after_s"]["by_priority"]["high"]),
        ("probes (advertised, real) normal",
         lambda s: s["retry_after_s"]["by_priority"]["normal"][:3]),
        ("probes (advertised, real) low", lambda s: s["retry_after_s"]["by_priority"]["low"][:3]),
        ("backend req / client req", lambda s: s["amplification"]),
        ("rejections by layer/priority", lambda s: s["gateway"]["rejections"]),
        ("mean queue wait by priority (s)", lambda s: s["gateway"]["queue_wait_mean_s"]),
    ]
    names = list(runs)
    print(f"\n{'':34}" + "".join(f"{n:>22}" for n in names))
    for label, fn in rows:
        print(f"{label:34}" + "".join(f"{fn(runs[n])!s:>22}" for n in names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--speed", type=float, default=0.25, help="simulator speed multiplier")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--factor", type=float, default=3.0, help="offered load / capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="overload seconds per run")
    ap.add_argument("--capacity-s", type=float, default=10.0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, s")
    ap.add_argument("--mix", default="0.2,0.5,0.3", help="high,normal,low shares")
    ap.add_argument("--probe-every", type=int, default=10)
    ap.add_argument("--in-flight-per-seq", type=float, default=None,
                    help="admission.in_flight_per_seq (default: the gateway's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "overload.json"))
    args = ap.parse_args(argv)

    logdir = Path(tempfile.mkdtemp(prefix="overload-"))
    procs = Procs(logdir, cwd=REPO)
    print(f"logs: {logdir}")
    urls: list[str] = []
    try:
        for i in range(args.backends):
            port = free_port()
            procs.start(f"sim{i}", cli(
                "sim", "--port", str(port), "--model", MODEL, "--seed", str(i + 1),
                "--max-num-seqs", str(args.max_num_seqs), "--speed", str(args.speed),
                "--log-level", "warning"))
            urls.append(f"http://127.0.0.1:{port}")

        async def go() -> dict[str, dict[str, Any]]:
            async with aiohttp.ClientSession() as s:
                for u in urls:
                    await wait_http(s, u + "/health")
            on, capacity = await run_one(True, urls, procs, args, None)
            await asyncio.sleep(3)
            off, _ = await run_one(False, urls, procs, args, capacity)
            return {"admission on": on, "admission off": off}

        runs = asyncio.run(go())
    finally:
        procs.stop_all()
    print_table(runs)
    on = runs["admission on"]
    high = on["ttft_p99_by_priority_s"]["high"]
    checks = {
        "high-priority P99 TTFT within SLO": high is not None and high <= args.slo_ttft,
        "every rejection carries Retry-After": on["every_429_has_retry_after"],
        "no request lost or answered twice": on["lost"] == 0 and on["answered_twice"] == 0,
    }
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "overload", "params": vars(args), "runs": runs,
                               "checks": checks}, indent=2))
    print(f"\nwritten: {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
