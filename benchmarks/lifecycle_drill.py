"""Lifecycle drill: maintenance cycles under a steady load must be invisible to clients.

Three simulated vLLM backends (in-process ``SimServerThread``s) serve ``m1`` behind the
gateway (in-process, under uvicorn in its own thread) with the maintenance cycles sped up as
``llm-gateway demo --fast-cycles`` does (``gateway.demo.FAST_CYCLES``: short every 5 s,
medium every 20 s with a 4 s rest, long every 120 s; slow start 5 s; drain deadline 10 s),
calibration on, and a restart hook (an HTTP call to this script's control server, which
really restarts that backend's simulator on its port). An open-loop load of ``--rate``
requests/s (half streams, half non-streams, 32-256 tokens each with ``ignore_eos``, so
0.3-3 s each) runs for ``--duration`` seconds; every answer is read to its end and checked.

The must-hold (issue 3): over a 2-minute run with at least 3 medium cycles, zero
client-visible errors and zero cut streams. Printed and written to ``--out`` (JSON):
cycles started/completed (short, medium, long), the longest drain (s), client requests,
client-visible errors (non-200 answers, transport errors, error events), cut streams (no
``[DONE]``, or an error event), answers the backend itself ended with ``finish_reason``
``abort``, and the most backends seen out of rotation at once (sampled every 50 ms).
Exit status 1 when the must-hold fails.

Usage::

    python benchmarks/lifecycle_drill.py                        # 120 s at 4 req/s
    python benchmarks/lifecycle_drill.py --duration 60 --rate 6 --medium-every 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.demo import with_fast_cycles
from gateway.serving import EmbeddedServer, uvicorn_config
from gateway.sim import SimConfig, SimServerThread
from gateway.wiring import Gateway

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "lifecycle_drill.json"
MODEL = "m1"
NAMES = ("sim-1", "sim-2", "sim-3")


# ---- servers ------------------------------------------------------------------------------


def bound_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    s.setblocking(False)
    return s


class Fleet:
    """The simulated backends; ``restart(name)`` stops one and serves a fresh one with the
    same config on the same port (what the restart hook asks for)."""

    def __init__(self) -> None:
        self.configs = {
            n: SimConfig(model=MODEL, engine_label=n, seed=i, stop_length_max=96)
            for i, n in enumerate(NAMES, 1)
        }
        self.servers: dict[str, SimServerThread] = {}
        self.ports: dict[str, int] = {}
        self.restarts: dict[str, int] = dict.fromkeys(NAMES, 0)
        self._lock = threading.Lock()
        for n in NAMES:
            s = SimServerThread(self.configs[n])
            url = s.start()
            self.servers[n] = s
            self.ports[n] = int(url.rsplit(":", 1)[1])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def restart(self, name: str) -> None:
        with self._lock:
            self.servers[name].stop()
            s = SimServerThread(self.configs[name], port=self.ports[name])
            s.start()
            self.servers[name] = s
            self.restarts[name] += 1

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


class ControlServer:
    """``POST /restart/{backend_id}``: the gateway's restart hook (runs in its own thread)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="control")
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def restart(request: web.Request) -> web.Response:
            name = request.match_info["backend_id"]
            if name not in self.fleet.servers:
                return web.json_response({"error": f"unknown backend {name}"}, status=404)
            await asyncio.get_running_loop().run_in_executor(None, self.fleet.restart, name)
            return web.json_response({"restarted": name})

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/restart/{backend_id}", restart)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.SockSite(runner, bound_socket())
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()


class GatewayServer:
    """The gateway app under uvicorn on its own event loop, in a thread."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.app = create_app(cfg)
        self.cfg = cfg
        sock = bound_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = EmbeddedServer(uvicorn_config(self.app, cfg))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway  # type: ignore[no-any-return]

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the gateway's loop (a consistent read of its state)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        try:
            self._task.result(20)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


def drill_config(fleet: Fleet, control_port: int, args: argparse.Namespace) -> GatewayConfig:
    """The gateway config: demo fast cycles, overridden by the command line."""
    base = GatewayConfig(
        backends=[{"id": n, "url": fleet.url(n), "max_num_seqs": 16} for n in NAMES],
        server={"graceful_shutdown_s": 5, "log_level": "warning"},
    )
    data = with_fast_cycles(base).model_dump(mode="json")
    lc = data["lifecycle"]
    lc["short"]["every_s"] = args.short_every
    lc["medium"]["every_s"] = args.medium_every
    lc["medium"]["cooldown_s"] = args.cooldown
    lc["long"]["every_s"] = args.long_every
    lc["restart_hook"] = {
        "url": f"http://127.0.0.1:{control_port}/restart/{{backend_id}}",
        "method": "POST",
        "timeout_s": 30,
    }
    data["calibration"]["enabled"] = True
    return GatewayConfig(**data)


# ---- load -------------------------------------------------------------------------------


@dataclass
class Result:
    stream: bool
    start: float
    end: float
    status: int = 0
    error: str | None = None  # client-visible error: status, transport, error event
    cut: bool = False  # a stream without [DONE] or with an error event
    aborted: bool = False  # finish_reason "abort" (the backend ended it itself)


async def one_request(
    session: aiohttp.ClientSession, url: str, stream: bool, max_tokens: int
) -> Result:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Story {max_tokens}."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    res = Result(stream, time.monotonic(), 0.0)
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            res.status = r.status
            if r.status != 200:  # an error answer (not a cut stream: none started)
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            if not stream:
                data = await r.json()
                if not data.get("choices"):
                    res.error = f"no choices: {str(data)[:200]}"
                else:
                    res.aborted = data["choices"][0].get("finish_reason") == "abort"
                return res
            buf = b""
            events: list[bytes] = []
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if ev.startswith(b"data: "):
                        events.append(ev[6:])
            done = events.count(b"[DONE]")
            if done != 1 or events[-1] != b"[DONE]" or buf.strip():
                res.cut = True
                res.error = f"stream without a final [DONE] ({done} [DONE], tail {buf[:80]!r})"
            for ev in events:
                if ev == b"[DONE]":
                    continue
                obj = json.loads(ev)
                if "error" in obj:
                    res.cut = True
                    res.error = f"error event: {obj['error']}"
                elif obj.get("choices") and obj["choices"][0].get("finish_reason") == "abort":
                    res.aborted = True
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        res.cut = stream and res.status == 200  # broke after the stream started
    finally:
        res.end = time.monotonic()
    return res


async def run_load(url: str, duration: float, rate: float, seed: int) -> list[Result]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    tasks: list[asyncio.Task[Result]] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < duration:
            tasks.append(
                asyncio.create_task(one_request(session, url, n % 2 == 0, rng.randint(32, 256)))
            )
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))


# ---- report -----------------------------------------------------------------------------


class Timeline(logging.Handler):
    """Keeps the gateway's lifecycle log lines (``backend X: a -> b (reason)``, drains,
    hooks) with their monotonic time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.getMessage()))


def windows(samples: list[tuple[float, int, int]], bad: Any) -> list[tuple[float, float]]:
    """Time windows (start, end; monotonic) over which ``bad(out, warm)`` held."""
    out: list[tuple[float, float]] = []
    start: float | None = None
    last = 0.0
    for t, o, w in samples:
        if bad(o, w):
            if start is None:
                start = t
            last = t
        elif start is not None:
            out.append((start, last))
            start = None
    if start is not None:
        out.append((start, last))
    return out


@dataclass
class Report:
    duration_s: float
    rate_per_s: float
    config: dict[str, Any]
    cycles_started: dict[str, int] = field(default_factory=dict)
    cycles_completed: dict[str, int] = field(default_factory=dict)
    longest_drain_s: float = 0.0
    drains: int = 0
    client_requests: int = 0
    streams: int = 0
    request_seconds: dict[str, float] = field(default_factory=dict)
    client_errors: int = 0
    cut_streams: int = 0
    aborted_by_backend: int = 0
    max_out_of_rotation: int = 0
    min_warm: int = 0
    over_max_unavailable_windows: list[tuple[float, float]] = field(default_factory=list)
    zero_warm_windows: list[tuple[float, float]] = field(default_factory=list)
    sim_restarts: dict[str, int] = field(default_factory=dict)
    transitions: dict[str, int] = field(default_factory=dict)
    final_states: dict[str, str] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    must_hold: bool = False
    timeline: list[str] = field(default_factory=list)


def counter(gw: Gateway, metric: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for fam in gw.metrics.registry.collect():
        for s in fam.samples:
            if s.name == metric:
                out[tuple(s.labels.values())] = s.value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--short-every", type=float, default=5.0)
    p.add_argument("--medium-every", type=float, default=20.0)
    p.add_argument("--cooldown", type=float, default=4.0, help="medium cycle rest, seconds")
    p.add_argument("--long-every", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--verbose", action="store_true", help="log every transition")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)

    timeline = Timeline()
    fleet_log = logging.getLogger("gateway.fleet")
    fleet_log.setLevel(logging.INFO)
    fleet_log.addHandler(timeline)
    if not args.verbose:  # keep transitions out of the console, but warnings in
        fleet_log.propagate = False
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        fleet_log.addHandler(console)

    fleet = Fleet()
    control = ControlServer(fleet)
    cfg = drill_config(fleet, control.port, args)
    gw = GatewayServer(cfg)
    g = gw.gateway
    deadline = time.monotonic() + 30
    while not all(b.routable for b in g.fleet):
        if time.monotonic() > deadline:
            raise SystemExit("backends did not become warm")
        time.sleep(0.05)
    lc = cfg.lifecycle
    print(
        f"lifecycle drill: {len(NAMES)} simulated backends behind {gw.url}; "
        f"{args.duration:g} s at {args.rate:g} req/s; short every {lc.short.every_s:g} s, "
        f"medium every {lc.medium.every_s:g} s (rest {lc.medium.cooldown_s:g} s), long every "
        f"{lc.long.every_s:g} s",
        flush=True,
    )

    out_samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            states = gw.call(lambda: [b.state.value for b in g.fleet])
            out_samples.append(
                (time.monotonic(), sum(s != "warm" for s in states), states.count("warm"))
            )
            time.sleep(0.05)

    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    t0 = time.monotonic()
    results = asyncio.run(run_load(gw.url, args.duration, args.rate, args.seed))
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(5)

    rep = Report(
        duration_s=round(elapsed, 1),
        rate_per_s=args.rate,
        config={
            "short_every_s": lc.short.every_s,
            "medium_every_s": lc.medium.every_s,
            "cooldown_s": lc.medium.cooldown_s,
            "long_every_s": lc.long.every_s,
            "slow_start_s": lc.slow_start_s,
            "drain_deadline_s": lc.drain_deadline_s,
        },
    )

    def collect() -> None:
        started = counter(g, "gateway_maintenance_cycles_total")
        for kind in ("short", "medium", "long"):
            rep.cycles_started[kind] = int(sum(v for k, v in started.items() if k[1] == kind))
        trans = counter(g, "gateway_backend_transitions_total")
        for (_b, frm, to, reason), v in trans.items():
            key = f"{frm}->{to} ({reason})"
            rep.transitions[key] = rep.transitions.get(key, 0) + int(v)
        rep.cycles_completed["medium"] = rep.transitions.get("cooldown->warm (cooldown_done)", 0)
        rep.cycles_completed["long"] = rep.transitions.get("draining->cold (restarted)", 0)
        failed_short = rep.transitions.get("warm->unhealthy (app_probe_failed)", 0)
        rep.cycles_completed["short"] = rep.cycles_started["short"] - failed_short
        rep.longest_drain_s = round(g.controller.longest_drain_s, 3)
        drains = counter(g, "gateway_drain_seconds_count")
        rep.drains = int(sum(drains.values()))
        rep.final_states = {b.id: b.state.value for b in g.fleet}

    gw.call(collect)
    rep.client_requests = len(results)
    rep.streams = sum(r.stream for r in results)
    errors = [r for r in results if r.error]
    rep.client_errors = len(errors)
    rep.cut_streams = sum(r.cut for r in results)
    rep.aborted_by_backend = sum(r.aborted for r in results)
    rep.error_samples = [f"{round(r.start - t0, 2)} s: {r.error}" for r in errors[:10]]
    took = sorted(r.end - r.start for r in results)
    if took:
        rep.request_seconds = {
            "p50": round(took[len(took) // 2], 3),
            "p99": round(took[int(len(took) * 0.99)], 3),
            "max": round(took[-1], 3),
        }
    rep.max_out_of_rotation = max((o for _, o, _ in out_samples), default=0)
    rep.min_warm = min((w for _, _, w in out_samples), default=0)
    max_out = max(1, len(NAMES) // 4)  # lifecycle.max_unavailable: max(1, 25%)
    rep.over_max_unavailable_windows = [
        (round(a - t0, 2), round(b - t0, 2))
        for a, b in windows(out_samples, lambda o, w: o > max_out)
    ]
    rep.zero_warm_windows = [
        (round(a - t0, 2), round(b - t0, 2)) for a, b in windows(out_samples, lambda o, w: w == 0)
    ]
    rep.timeline = [f"{t - t0:8.2f} {line}" for t, line in timeline.lines]
    rep.sim_restarts = dict(fleet.restarts)
    rep.must_hold = (
        rep.client_errors == 0 and rep.cut_streams == 0 and rep.cycles_completed["medium"] >= 3
    )

    gw.stop()
    fleet.stop()

    print(
        f"cycles completed: medium {rep.cycles_completed['medium']} "
        f"(started {rep.cycles_started['medium']}), short {rep.cycles_completed['short']} "
        f"(started {rep.cycles_started['short']}), long {rep.cycles_completed['long']} "
        f"(started {rep.cycles_started['long']})"
    )
    print(f"longest drain: {rep.longest_drain_s:.3f} s over {rep.drains} drains")
    print(
        f"client requests: {rep.client_requests} ({rep.streams} streams; duration "
        f"{rep.request_seconds})"
    )
    print(f"client-visible errors: {rep.client_errors}")
    print(f"cut streams: {rep.cut_streams}")
    print(f"answers ended by a backend (finish_reason abort): {rep.aborted_by_backend}")
    print(
        f"most backends out of rotation at once: {rep.max_out_of_rotation} "
        f"(fewest warm: {rep.min_warm})"
    )
    if rep.over_max_unavailable_windows:
        print(
            f"  more than max_unavailable ({max_out}) out, s since start: "
            f"{rep.over_max_unavailable_windows}"
        )
    if rep.zero_warm_windows:
        print(f"  zero warm backends, s since start: {rep.zero_warm_windows}")
    for line in rep.error_samples:
        print(f"  error at {line}")
    print(
        f"must hold (0 errors, 0 cut streams, >= 3 medium cycles): "
        f"{'PASS' if rep.must_hold else 'FAIL'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(rep), indent=2) + "\n")
    print(f"written: {args.out}")
    return 0 if rep.must_hold else 1


if __name__ == "__main__":
    sys.exit(main())
