"""Closed-loop load generator for one benchmark cell (aiohttp client, own process).

``--concurrency`` workers each send a chat completion, read the answer to its end, verify it
and send the next (at once, or at the next slot of a shared ``--rate`` schedule), first for
``--warmup`` seconds (not counted), then, after every warm-up request has finished, for
``--duration`` seconds. The measured window runs from the moment
the workers are released to the moment the last of them has finished its last request, and
the CPU time (utime + stime from ``/proc/PID/stat``) of every ``--watch NAME=PID`` process is
read right at both ends, so the CPU and the requests counted belong to the same window (with
the machine's CPU time by kind, from ``/proc/stat``, to tell how busy everything else was).

Verification: status 200, and the body equal to the fast backend's fixed answer
(``--verify exact``, the default; a proxy forwards bodies unchanged) or, with
``--verify basic``, a ``chat.completion`` object / a stream that ends with ``data: [DONE]``.

Prints one JSON object on stdout. Run by ``benchmarks/proxy_overhead.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_backend import MODEL, completion_body, stream_body

CLK_TCK = os.sysconf("SC_CLK_TCK")
DONE = b"data: [DONE]\n\n"
HEADERS = {"content-type": "application/json"}


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu_seconds() -> dict[str, float]:
    """CPU seconds of all CPUs since boot by kind (``/proc/stat``: user, system, softirq...)."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return {k: v / CLK_TCK for k, v in zip(STAT_FIELDS, fields, strict=False)}


def request_body(stream: bool) -> bytes:
    payload: dict[str, object] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence."},
        ],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    if stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..1)."""
    if not sorted_values:
        return math.nan
    i = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.samples) < 5:
            self.samples.append(what)


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = args.url.rstrip("/") + "/v1/chat/completions"
        self.stream = args.mode == "stream"
        self.body = request_body(self.stream)
        self.concurrency = args.concurrency
        self.interval = 1.0 / args.rate if args.rate else 0.0
        self._next = 0.0
        if args.verify == "exact":
            self.expect: bytes | None = (
                stream_body(args.chunks) if self.stream else completion_body()
            )
        else:
            self.expect = None

    def check(self, status: int, body: bytes) -> str | None:
        if status != 200:
            return f"HTTP {status}: {body[:200]!r}"
        if self.expect is not None:
            if body != self.expect:
                return f"body differs ({len(body)} bytes, want {len(self.expect)}): {body[:200]!r}"
            return None
        if self.stream:
            return None if body.endswith(DONE) else f"stream without [DONE]: {body[-200:]!r}"
        return None if b'"chat.completion"' in body else f"not a completion: {body[:200]!r}"

    async def worker(self, session: aiohttp.ClientSession, until: float, tally: Tally) -> None:
        url, body, stream = self.url, self.body, self.stream
        clock = time.perf_counter
        interval = self.interval
        while clock() < until:
            if interval:  # paced: the next free slot of the shared schedule
                slot = self._next = max(self._next + interval, clock())
                if slot >= until:
                    break
                delay = slot - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
            t0 = clock()
            try:
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    if stream:
                        parts = [chunk async for chunk in resp.content.iter_any()]
                        data = b"".join(parts)
                    else:
                        data = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                tally.error(f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.01)
                continue
            dt = clock() - t0
            problem = self.check(status, data)
            if problem is None:
                tally.latencies.append(dt)
            else:
                tally.error(problem)

    async def phase(self, session: aiohttp.ClientSession, seconds: float) -> Tally:
        tally = Tally()
        until = time.perf_counter() + seconds
        await asyncio.gather(*(self.worker(session, until, tally) for _ in range(self.concurrency)))
        return tally


async def run(args: argparse.Namespace) -> dict[str, object]:
    watch: dict[str, int] = {}
    for w in args.watch:
        name, _, pid = w.partition("=")
        watch[name] = int(pid)
    load = Load(args)
    connector = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warm = await load.phase(session, args.warmup) if args.warmup > 0 else Tally()
        cpu0 = {name: cpu_seconds(pid) for name, pid in watch.items()}
        mach0 = machine_cpu_seconds()
        self0 = os.times()
        t0 = time.perf_counter()
        tally = await load.phase(session, args.duration)
        elapsed = time.perf_counter() - t0
        self1 = os.times()
        mach1 = machine_cpu_seconds()
        cpu1 = {name: cpu_seconds(pid) for name, pid in watch.items()}
    lat = sorted(tally.latencies)
    ok = len(lat)
    ms = 1000.0
    return {
        "target": args.url,
        "mode": args.mode,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "duration_s": args.duration,
        "elapsed_s": elapsed,
        "ok": ok,
        "errors": tally.errors,
        "error_samples": tally.samples,
        "warmup_ok": len(warm.latencies),
        "warmup_errors": warm.errors,
        "warmup_error_samples": warm.samples,
        "rps": ok / elapsed if elapsed > 0 else 0.0,
        "latency_ms": {
            "p50": percentile(lat, 0.50) * ms,
            "p90": percentile(lat, 0.90) * ms,
            "p99": percentile(lat, 0.99) * ms,
            "mean": (sum(lat) / ok * ms) if ok else math.nan,
            "max": (lat[-1] * ms) if ok else math.nan,
        },
        "cpu_s": {name: cpu1[name] - cpu0[name] for name in watch},
        "loadgen_cpu_s": (self1.user + self1.system) - (self0.user + self0.system),
        "machine_cpu_s": {k: mach1[k] - mach0[k] for k in mach0},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="closed-loop chat-completions load for one cell")
    p.add_argument("--url", required=True, help="base URL of the target (no path)")
    p.add_argument("--mode", choices=("nonstream", "stream"), required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="pace to this many requests/s in total (0: closed loop, as fast as answered)",
    )
    p.add_argument("--chunks", type=int, default=10, help="events the fast backend sends")
    p.add_argument("--verify", choices=("exact", "basic"), default="exact")
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument(
        "--watch",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="process whose CPU time to measure over the window (repeatable)",
    )
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
