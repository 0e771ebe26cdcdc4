"""Proxy overhead: the gateway against a bare FastAPI + aiohttp pass-through, same run.

The same closed-loop load (chat completions, non-stream and stream, each concurrency) is sent
for a bounded time, after a short warm-up, to three targets:

* ``direct``: the fast backend itself (``benchmarks/fast_backend.py``: fixed JSON answer, fixed
  SSE stream of ``--chunks`` events, a few microseconds per request);
* ``bare``: ``benchmarks/bare_proxy.py`` (FastAPI + one aiohttp session, ~30 lines) in front of
  it;
* ``gateway``: ``llm-gateway serve`` with a generated config (one backend serving
  ``bench-model``, access log off) in front of it;
* ``gateway-fleet`` (only when named in ``--targets``): the same gateway in fleet mode
  (issue 14), ``coordination.redis_url`` pointing at a ``redis-server`` the script starts on a
  free port (no persistence): one replica, its coordination loop and heartbeats running.

Every server runs in its own process; both proxies under uvicorn with the same settings (one
worker, no access log; the bare proxy gets what ``uvicorn.run`` picks: uvloop + httptools, and
the gateway whatever its own ``serve`` sets up). Each cell (target x mode x concurrency) runs a
fresh load generator process (``benchmarks/loadgen.py``, aiohttp) that reads every answer to
its end and checks it byte for byte, and reads the CPU time (utime + stime, /proc/PID/stat) of
the proxies and the backend at both ends of its measured window. Reported per cell:
requests/s, p50/p99 latency, and CPU milliseconds per request of each process; per mode and
concurrency, the gateway/bare ratio of CPU per request (median over ``--repeat``). The
acceptance bar: at concurrency 64, stream and non-stream, gateway <= 1.3x bare. With
``gateway-fleet``, also the fleet/gateway ratio of the gateway process's CPU per request
(coordination on vs off, same run; bar: <= 1.10x at concurrency 64, issue 14) and, beside
it, the same ratio with the Redis server's CPU added to the fleet side.

Noise: CPU per request moves with whatever else runs on the machine. Before each cell the
script waits (``--quiet-wait``, up to 30 s) until other processes use at most
``--quiet-threshold`` cores, measures a cell again (``--retry-noisy``) when they used more
during it, and reports what they used ("other CPU"); compare ratios from the same run, and use
``--repeat`` (the ratio reported is the median of the per-run ratios).

Usage::

    python benchmarks/proxy_overhead.py                       # 6 s cells, 1 repeat
    python benchmarks/proxy_overhead.py --repeat 3 --duration 5 --concurrency 1,64
    python benchmarks/proxy_overhead.py --modes stream --targets bare,gateway --pin
    python benchmarks/proxy_overhead.py --repeat 3 --concurrency 64 \
        --targets bare,gateway,gateway-fleet --pin            # fleet mode's overhead
    python benchmarks/proxy_overhead.py --rate 500         # paced load instead of closed loop
    python benchmarks/proxy_overhead.py --gateway-cmd "{python} my_patched_gateway.py -c {config}"

Results go to ``--out`` (JSON, default ``benchmarks/results/proxy_overhead.json``); server
logs to a temporary directory that is kept (and printed) when something fails. Exit status: 0
done, 1 some answers failed verification, 2 a server failed to start or a check failed, 130
interrupted (Ctrl-C or SIGTERM; every child process is stopped either way). The acceptance
verdict is printed and stored, not turned into the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from fast_backend import MODEL, completion_body, stream_body  # noqa: E402
from loadgen import cpu_seconds, machine_cpu_seconds, request_body  # noqa: E402

DEFAULT_OUT = HERE / "results" / "proxy_overhead.json"
TARGETS = ("direct", "bare", "gateway", "gateway-fleet")
DEFAULT_TARGETS = ("direct", "bare", "gateway")
PROXIES = ("bare", "gateway", "gateway-fleet")
GATEWAYS = ("gateway", "gateway-fleet")
MODES = ("nonstream", "stream")
ACCEPT_RATIO = 1.3
ACCEPT_CONCURRENCY = 64
FLEET_RATIO = 1.10  # issue 14: CPU per request with coordination on vs off, one replica
NOISY_CORES = 0.15  # other processes' CPU (cores) above which a cell counts as noisy

# Wide enough for the tables when the output is a file or a pipe (rich assumes 80 then).
console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)


class BenchError(RuntimeError):
    """A server failed to start or a check failed; the message says which and why."""


# ---- processes ----------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Procs:
    """Every child process of the benchmark; :meth:`stop_all` ends them (TERM, then KILL)."""

    logdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, cmd: Sequence[str], cpus: set[int] | None = None, **kw: Any) -> Proc:
        log = self.logdir / f"{name}.log"
        fh = open(log, "wb")
        try:
            popen = subprocess.Popen(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=kw.pop("stdout", fh),
                stderr=fh,
                cwd=str(REPO),
                start_new_session=True,  # a terminal's Ctrl-C reaches only us; we stop them
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
                **kw,
            )
        finally:
            fh.close()
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def stop(self, p: Proc, timeout: float = 5.0) -> None:
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
            try:
                p.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                p.popen.wait(5)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self) -> None:
        live = [p for p in self.procs if p.alive()]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in live:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(5)
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_post(port: int, path: str, body: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_ready(p: Proc, port: int, path: str, timeout: float = 30.0) -> None:
    """Until GET ``path`` answers 200; raises :class:`BenchError` if the process dies."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not p.alive():
            raise BenchError(
                f"{p.name} exited with {p.popen.returncode} while starting; its log:\n"
                + p.log_tail()
            )
        try:
            status, body = http_get(port, path, timeout=1.0)
            if status == 200:
                return
            last = f"{status} {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        time.sleep(0.1)
    raise BenchError(
        f"{p.name} not ready after {timeout:g} s (GET {path}: {last}); log:\n" + p.log_tail()
    )


def wait_port(p: Proc, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not p.alive():
            raise BenchError(f"{p.name} exited with {p.popen.returncode}; log:\n" + p.log_tail())
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise BenchError(
        f"{p.name} does not listen on {port} after {timeout:g} s; log:\n" + p.log_tail()
    )


# ---- the servers ---------------------------------------------------------------------------
def gateway_command(template: str | None, config: Path) -> list[str]:
    """``llm-gateway serve -c CONFIG``, or ``--gateway-cmd`` with ``{config}``/``{python}``."""
    if template:
        return [
            part.replace("{config}", str(config)).replace("{python}", sys.executable)
            for part in shlex.split(template)
        ]
    exe = shutil.which("llm-gateway", path=str(Path(sys.executable).parent))
    return [*([exe] if exe else [sys.executable, "-m", "gateway.cli"]), "serve", "-c", str(config)]


def write_gateway_config(
    path: Path, port: int, backend_port: int, redis_url: str | None = None
) -> dict[str, Any]:
    """One backend serving ``bench-model``, access log off (the default), and, where the
    config has them, the maintenance cycles off: a drain or cooldown in the middle of a cell
    would measure the lifecycle, not the data path. ``redis_url``: fleet mode on (the
    coordination defaults otherwise)."""
    cfg: dict[str, Any] = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "log_level": "warning",
            "access_log": False,
            "graceful_shutdown_s": 2,
        },
        "backends": [{"id": "bench", "url": f"http://127.0.0.1:{backend_port}", "models": [MODEL]}],
    }
    if redis_url is not None:
        cfg["coordination"] = {"redis_url": redis_url, "namespace": "bench"}
    try:  # validate here, with the config's own message, rather than in the child
        from gateway.config import ConfigError, GatewayConfig, load_config
    except ImportError:
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return cfg
    if "lifecycle" in GatewayConfig.model_fields:
        cfg["lifecycle"] = {
            "short": {"every_s": 0},
            "medium": {"every_s": 0, "every_requests": 0},
            "long": {"every_s": 0},
        }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        load_config(path)
    except ConfigError as e:
        raise BenchError(f"generated gateway config is invalid: {e}") from None
    return cfg


@dataclass
class Servers:
    ports: dict[str, int]
    procs: dict[str, Proc]
    gateway_config: dict[str, Any] | None
    fleet_config: dict[str, Any] | None = None


def start_redis(procs: Procs, cpus: set[int] | None) -> tuple[Proc, int]:
    """A ``redis-server`` (or ``valkey-server``) on a free loopback port, no persistence."""
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        raise BenchError(
            "target gateway-fleet needs redis-server on PATH (apt-get install redis-server)"
        )
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
           "no", "--dir", str(procs.logdir)]
    p = procs.start("redis", cmd, cpus)
    wait_port(p, port)
    return p, port


def check_fleet_mode(port: int, timeout: float = 15.0) -> None:
    """The fleet target's coordination is up (else the run would measure the local share)."""
    deadline = time.monotonic() + timeout
    view: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            status, body = http_get(port, "/admin/fleet")
            view = json.loads(body) if status == 200 else body[:200]
            if isinstance(view, dict) and view.get("fleet_mode") and view["store"]["up"]:
                return
        time.sleep(0.2)
    raise BenchError(f"gateway-fleet: the shared store is not up: /admin/fleet says {view!r}")


def start_servers(
    procs: Procs, targets: Sequence[str], args: argparse.Namespace, cpus: dict[str, set[int]]
) -> Servers:
    py = sys.executable
    ports = {"backend": free_port()}
    started: dict[str, Proc] = {}
    backend_cmd = [
        py,
        str(HERE / "fast_backend.py"),
        "--port",
        str(ports["backend"]),
        "--chunks",
        str(args.chunks),
        "--stream-gap-ms",
        str(args.stream_gap_ms),
    ]
    started["backend"] = procs.start("backend", backend_cmd, cpus.get("backend"))
    wait_ready(started["backend"], ports["backend"], "/health")
    upstream = f"http://127.0.0.1:{ports['backend']}"
    gw_cfg = None
    if "bare" in targets:
        ports["bare"] = free_port()
        cmd = [
            py,
            str(HERE / "bare_proxy.py"),
            "--port",
            str(ports["bare"]),
            "--upstream",
            upstream,
        ]
        started["bare"] = procs.start("bare", cmd, cpus.get("bare"))
    if "gateway" in targets:
        ports["gateway"] = free_port()
        cfg_path = procs.logdir / "gateway.yaml"
        gw_cfg = write_gateway_config(cfg_path, ports["gateway"], ports["backend"])
        cmd = gateway_command(args.gateway_cmd, cfg_path)
        started["gateway"] = procs.start("gateway", cmd, cpus.get("gateway"))
    fleet_cfg = None
    if "gateway-fleet" in targets:
        started["redis"], ports["redis"] = start_redis(procs, cpus.get("redis"))
        ports["gateway-fleet"] = free_port()
        cfg_path = procs.logdir / "gateway-fleet.yaml"
        fleet_cfg = write_gateway_config(
            cfg_path, ports["gateway-fleet"], ports["backend"],
            redis_url=f"redis://127.0.0.1:{ports['redis']}/0",
        )
        cmd = gateway_command(args.gateway_cmd, cfg_path)
        started["gateway-fleet"] = procs.start("gateway-fleet", cmd, cpus.get("gateway-fleet"))
    if "bare" in started:
        wait_port(started["bare"], ports["bare"])
    for name in GATEWAYS:
        if name in started:
            wait_ready(started[name], ports[name], "/ready/fleet")  # a backend routable
    if "gateway-fleet" in started:
        check_fleet_mode(ports["gateway-fleet"])
    ports["direct"] = ports["backend"]
    return Servers(ports, started, gw_cfg, fleet_cfg)


def smoke_check(servers: Servers, targets: Sequence[str], chunks: int) -> None:
    """One request per target and mode, answer compared byte for byte."""
    want = {"nonstream": completion_body(), "stream": stream_body(chunks)}
    for target in targets:
        for mode in MODES:
            status, body = http_post(
                servers.ports[target], "/v1/chat/completions", request_body(mode == "stream")
            )
            if status != 200 or body != want[mode]:
                raise BenchError(
                    f"smoke check failed: {target} {mode}: HTTP {status}, body {body[:300]!r}"
                )


def idle_cpu(servers: Servers, seconds: float) -> dict[str, float]:
    """CPU seconds per second each server burns with no client traffic (control loops)."""
    if seconds <= 0:
        return {}
    pids = {name: p.pid for name, p in servers.procs.items()}
    c0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
    t0 = time.perf_counter()
    time.sleep(seconds)
    dt = time.perf_counter() - t0
    return {n: (cpu_seconds(pid) - c0[n]) / dt for n, pid in pids.items()}


# ---- noise from other jobs -------------------------------------------------------------------
def other_cores(machine_delta: dict[str, float], ours_s: float, seconds: float) -> float:
    """Cores' worth of user + system time that processes other than ours used."""
    busy = sum(machine_delta.get(k, 0.0) for k in ("user", "nice", "system"))
    return max(0.0, busy - ours_s) / seconds if seconds > 0 else 0.0


def sample_other_cores(servers: Servers, seconds: float = 0.5) -> float:
    pids = [p.pid for p in servers.procs.values()]
    m0, c0, t0 = machine_cpu_seconds(), sum(map(cpu_seconds, pids)), time.perf_counter()
    time.sleep(seconds)
    m1, c1, t1 = machine_cpu_seconds(), sum(map(cpu_seconds, pids)), time.perf_counter()
    return other_cores({k: m1[k] - m0[k] for k in m0}, c1 - c0, t1 - t0)


def wait_quiet(servers: Servers, threshold: float, max_wait: float) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until other processes use at most ``threshold`` cores.

    Returns (seconds waited, the last sample). On a shared machine this keeps cells away
    from other people's test runs; a cell that could not wait it out is flagged by its
    ``other_cpu_cores``."""
    start = time.monotonic()
    other = sample_other_cores(servers)
    while other > threshold and time.monotonic() - start < max_wait:
        time.sleep(0.5)
        other = sample_other_cores(servers)
    return time.monotonic() - start, other


# ---- cells ----------------------------------------------------------------------------------
def run_cell(
    procs: Procs,
    servers: Servers,
    target: str,
    mode: str,
    concurrency: int,
    args: argparse.Namespace,
    cpus: set[int] | None,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(HERE / "loadgen.py"),
        "--url",
        f"http://127.0.0.1:{servers.ports[target]}",
        "--mode",
        mode,
        "--concurrency",
        str(concurrency),
        "--duration",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--chunks",
        str(args.chunks),
        "--rate",
        str(args.rate),
    ]
    for name, p in servers.procs.items():
        cmd += ["--watch", f"{name}={p.pid}"]
    out = procs.logdir / "loadgen.out"
    with open(out, "wb") as fh:
        lg = procs.start("loadgen", cmd, cpus, stdout=fh)
    try:
        rc = lg.popen.wait(args.warmup + args.duration + 120)
    except subprocess.TimeoutExpired:
        raise BenchError(f"load generator hung ({target} {mode} c={concurrency})") from None
    finally:
        procs.stop(lg)
    if rc != 0:
        raise BenchError(
            f"load generator failed (exit {rc}) on {target} {mode} "
            f"c={concurrency}:\n{lg.log_tail()}"
        )
    for name, p in servers.procs.items():
        if not p.alive():
            raise BenchError(
                f"{name} died during {target} {mode} c={concurrency}; log:\n" + p.log_tail()
            )
    res: dict[str, Any] = json.loads(out.read_text())
    ok = res["ok"]
    cell: dict[str, Any] = {
        "target": target,
        "mode": mode,
        "concurrency": concurrency,
        "ok": ok,
        "errors": res["errors"],
        "error_samples": res["error_samples"],
        "warmup_ok": res["warmup_ok"],
        "warmup_errors": res["warmup_errors"],
        "elapsed_s": res["elapsed_s"],
        "rps": res["rps"],
        "latency_ms": res["latency_ms"],
        "cpu_s": res["cpu_s"],
        "loadgen_cpu_s": res["loadgen_cpu_s"],
        "cpu_ms_per_req": {
            name: (1000.0 * s / ok if ok else None) for name, s in res["cpu_s"].items()
        },
        "loadgen_cpu_ms_per_req": 1000.0 * res["loadgen_cpu_s"] / ok if ok else None,
        "machine_cpu_s": res["machine_cpu_s"],
        # CPU the rest of the machine used meanwhile (cores): other jobs add noise.
        "other_cpu_cores": other_cores(
            res["machine_cpu_s"],
            sum(res["cpu_s"].values()) + res["loadgen_cpu_s"],
            res["elapsed_s"],
        ),
    }
    cell["proxy_cpu_ms_per_req"] = cell["cpu_ms_per_req"].get(target) if target in PROXIES else None
    return cell


def cell_order(
    repeat: int, modes: Sequence[str], concs: Sequence[int], targets: Sequence[str]
) -> Iterator[tuple[int, str, int, str]]:
    """Targets innermost, so the three targets of one condition run back to back; the
    target order rotates each repeat so none is always first after a change of mode."""
    for r in range(repeat):
        for mode in modes:
            for c in concs:
                rot = r % len(targets)
                for t in [*targets[rot:], *targets[:rot]]:
                    yield r, mode, c, t


# ---- summary ---------------------------------------------------------------------------------
def median(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarise(
    cells: list[dict[str, Any]], modes: Sequence[str], concs: Sequence[int], targets: Sequence[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    summary = []
    for mode in modes:
        for c in concs:
            for t in targets:
                cs = [
                    x for x in cells if (x["target"], x["mode"], x["concurrency"]) == (t, mode, c)
                ]
                if not cs:
                    continue
                summary.append(
                    {
                        "target": t,
                        "mode": mode,
                        "concurrency": c,
                        "runs": len(cs),
                        "ok": sum(x["ok"] for x in cs),
                        "errors": sum(x["errors"] for x in cs),
                        "rps": median([x["rps"] for x in cs]),
                        "p50_ms": median([x["latency_ms"]["p50"] for x in cs]),
                        "p99_ms": median([x["latency_ms"]["p99"] for x in cs]),
                        "proxy_cpu_ms_per_req": median([x["proxy_cpu_ms_per_req"] for x in cs]),
                        "backend_cpu_ms_per_req": median(
                            [x["cpu_ms_per_req"].get("backend") for x in cs]
                        ),
                        "loadgen_cpu_ms_per_req": median([x["loadgen_cpu_ms_per_req"] for x in cs]),
                        "other_cpu_cores": median([x["other_cpu_cores"] for x in cs]),
                    }
                )
    ratios = []
    for mode in modes:
        for c in concs:
            per_rep: list[float] = []
            extra_us: list[float] = []
            reps = sorted({x["repeat"] for x in cells})
            for r in reps:
                got = {
                    x["target"]: x["proxy_cpu_ms_per_req"]
                    for x in cells
                    if (x["mode"], x["concurrency"], x["repeat"]) == (mode, c, r)
                    and x["target"] in PROXIES
                }
                if got.get("bare") and got.get("gateway") is not None:
                    per_rep.append(got["gateway"] / got["bare"])
                    extra_us.append(1000.0 * (got["gateway"] - got["bare"]))
            if per_rep:
                ratios.append(
                    {
                        "mode": mode,
                        "concurrency": c,
                        "ratios": per_rep,
                        "median_ratio": statistics.median(per_rep),
                        "min_ratio": min(per_rep),
                        "max_ratio": max(per_rep),
                        "median_extra_us_per_req": statistics.median(extra_us),
                    }
                )
    return summary, ratios


def fleet_ratios(
    cells: list[dict[str, Any]], modes: Sequence[str], concs: Sequence[int]
) -> list[dict[str, Any]]:
    """Per mode and concurrency: the gateway process's CPU per request with coordination on
    (``gateway-fleet``) over off (``gateway``), per repeat and their median; and the same
    with the Redis server's CPU during the fleet cell added to the fleet side."""
    out = []
    for mode in modes:
        for c in concs:
            per_rep: list[float] = []
            with_redis: list[float] = []
            for r in sorted({x["repeat"] for x in cells}):
                got = {
                    x["target"]: x
                    for x in cells
                    if (x["mode"], x["concurrency"], x["repeat"]) == (mode, c, r)
                }
                on, off = got.get("gateway-fleet"), got.get("gateway")
                if not on or not off or not off["proxy_cpu_ms_per_req"]:
                    continue
                if on["proxy_cpu_ms_per_req"] is None:
                    continue
                per_rep.append(on["proxy_cpu_ms_per_req"] / off["proxy_cpu_ms_per_req"])
                redis = on["cpu_ms_per_req"].get("redis") or 0.0
                with_redis.append(
                    (on["proxy_cpu_ms_per_req"] + redis) / off["proxy_cpu_ms_per_req"]
                )
            if per_rep:
                out.append(
                    {
                        "mode": mode,
                        "concurrency": c,
                        "ratios": per_rep,
                        "median_ratio": statistics.median(per_rep),
                        "ratios_with_redis": with_redis,
                        "median_ratio_with_redis": statistics.median(with_redis),
                    }
                )
    return out


def fleet_acceptance(fratios: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Issue 14's bar (gateway process CPU/request, coordination on <= 1.10x off, at 64);
    None when ``gateway-fleet`` was not measured. ``passed`` as in :func:`acceptance`."""
    if not fratios:
        return None
    checks = {
        r["mode"]: {"median_ratio": r["median_ratio"],
                    "passed": r["median_ratio"] <= FLEET_RATIO}
        for r in fratios
        if r["concurrency"] == ACCEPT_CONCURRENCY
    }
    passed: bool | None = None
    if any(not c["passed"] for c in checks.values()):
        passed = False
    elif len(checks) == len(MODES):
        passed = True
    return {
        "bar": f"gateway CPU/request with coordination on <= {FLEET_RATIO}x off at "
        f"concurrency {ACCEPT_CONCURRENCY}, stream and non-stream",
        "checks": checks,
        "passed": passed,
    }


def acceptance(ratios: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's bar. ``passed`` is None unless both modes were measured at 64 (a run of
    one mode or without concurrency 64 can fail the bar, never pass it)."""
    checks = {}
    for mode in MODES:
        r = next(
            (x for x in ratios if x["mode"] == mode and x["concurrency"] == ACCEPT_CONCURRENCY),
            None,
        )
        if r is not None:
            checks[mode] = {
                "median_ratio": r["median_ratio"],
                "passed": r["median_ratio"] <= ACCEPT_RATIO,
            }
    passed: bool | None = None
    if any(not c["passed"] for c in checks.values()):
        passed = False
    elif len(checks) == len(MODES):
        passed = True
    return {
        "bar": f"gateway CPU/request <= {ACCEPT_RATIO}x bare at concurrency "
        f"{ACCEPT_CONCURRENCY}, stream and non-stream",
        "checks": checks,
        "passed": passed,
    }


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def noisy(cores: float | None) -> str:
    text = fmt(cores, ".2f")
    return f"[yellow]{text}[/yellow]" if cores is not None and cores > NOISY_CORES else text


def print_fleet_table(fratios: list[dict[str, Any]], facc: dict[str, Any] | None) -> None:
    """Coordination on vs off (``gateway-fleet`` / ``gateway``), CPU per request."""
    if not fratios or facc is None:
        return
    ft = Table(title="Fleet mode on / off (gateway-fleet / gateway), gateway CPU per request")
    for col in ("mode", "conc", "median ratio", "per run", "+ redis CPU", "bar"):
        ft.add_column(col, justify="left" if col in ("mode", "per run") else "right")
    for r in fratios:
        bar = ""
        if r["concurrency"] == ACCEPT_CONCURRENCY:
            ok = r["median_ratio"] <= FLEET_RATIO
            bar = (
                f"[green]<= {FLEET_RATIO} ok[/green]"
                if ok
                else f"[red]> {FLEET_RATIO} FAIL[/red]"
            )
        ft.add_row(
            r["mode"],
            str(r["concurrency"]),
            f"{r['median_ratio']:.3f}x",
            " ".join(f"{x:.3f}" for x in r["ratios"]),
            f"{r['median_ratio_with_redis']:.3f}x",
            bar,
        )
    console.print(ft)
    if facc["passed"] is not None:
        verdict = "[green]PASS[/green]" if facc["passed"] else "[red]FAIL[/red]"
    else:
        verdict = "[yellow]not decided[/yellow] (needs both modes at concurrency 64)"
    console.print(f"fleet acceptance ({facc['bar']}): {verdict}")


def print_tables(
    summary: list[dict[str, Any]],
    ratios: list[dict[str, Any]],
    acc: dict[str, Any],
    idle: dict[str, float],
    repeat: int,
) -> None:
    t = Table(title=f"Proxy overhead (median of {repeat} run{'s' if repeat > 1 else ''} per cell)")
    for col, just in [
        ("target", "left"),
        ("mode", "left"),
        ("conc", "right"),
        ("req/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("proxy CPU ms/req", "right"),
        ("backend CPU ms/req", "right"),
        ("loadgen CPU ms/req", "right"),
        ("other CPU (cores)", "right"),
        ("errors", "right"),
    ]:
        t.add_column(col, justify=just, no_wrap=col == "target")  # type: ignore[arg-type]
    prev = None
    for s in summary:
        key = (s["mode"], s["concurrency"])
        if prev is not None and key != prev:
            t.add_section()
        prev = key
        style = "bold" if s["target"] in GATEWAYS else None
        t.add_row(
            s["target"],
            s["mode"],
            str(s["concurrency"]),
            fmt(s["rps"], ".0f"),
            fmt(s["p50_ms"], ".2f"),
            fmt(s["p99_ms"], ".2f"),
            fmt(s["proxy_cpu_ms_per_req"]),
            fmt(s["backend_cpu_ms_per_req"]),
            fmt(s["loadgen_cpu_ms_per_req"]),
            noisy(s["other_cpu_cores"]),
            f"[red]{s['errors']}[/red]" if s["errors"] else "0",
            style=style,
        )
    console.print(t)
    if ratios:
        rt = Table(title="Gateway / bare pass-through, CPU per request")
        for col in ("mode", "conc", "median ratio", "per run", "extra us/req", "bar"):
            rt.add_column(col, justify="left" if col in ("mode", "per run") else "right")
        for r in ratios:
            bar = ""
            if r["concurrency"] == ACCEPT_CONCURRENCY:
                ok = r["median_ratio"] <= ACCEPT_RATIO
                bar = (
                    f"[green]<= {ACCEPT_RATIO} ok[/green]"
                    if ok
                    else f"[red]> {ACCEPT_RATIO} FAIL[/red]"
                )
            rt.add_row(
                r["mode"],
                str(r["concurrency"]),
                f"{r['median_ratio']:.2f}x",
                " ".join(f"{x:.2f}" for x in r["ratios"]),
                f"{r['median_extra_us_per_req']:.0f}",
                bar,
            )
        console.print(rt)
    if any((s["other_cpu_cores"] or 0) > NOISY_CORES for s in summary):
        console.print(
            f"[yellow]other processes used > {NOISY_CORES} cores during some cells: "
            "their numbers are noisier (other CPU column)[/yellow]"
        )
    if idle:
        console.print(
            "idle CPU (control loops, no traffic): "
            + ", ".join(f"{n} {1000 * v:.1f} ms/s" for n, v in idle.items())
        )
    if acc["passed"] is not None:
        verdict = "[green]PASS[/green]" if acc["passed"] else "[red]FAIL[/red]"
    else:
        verdict = "[yellow]not decided[/yellow] (needs both modes at concurrency 64)"
    console.print(f"acceptance ({acc['bar']}): {verdict}")


# ---- metadata -------------------------------------------------------------------------------
def source_fingerprint() -> str:
    """sha1 of the repo's gateway sources (``gateway/**/*.py``), to notice edits during a run
    (what ``llm-gateway serve`` runs; with ``--gateway-cmd`` it may be something else)."""
    h = hashlib.sha1()
    for path in sorted((REPO / "gateway").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode())
        with contextlib.suppress(OSError):
            h.update(path.read_bytes())
    return h.hexdigest()


def run_meta(args: argparse.Namespace, cpus: dict[str, set[int]]) -> dict[str, Any]:
    versions = {}
    for pkg in (
        "fastapi",
        "starlette",
        "uvicorn",
        "aiohttp",
        "uvloop",
        "httptools",
        "prometheus-client",
        "pydantic",
    ):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    cpu_model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    git: dict[str, Any] = {}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git["commit"] = subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=REPO, text=True, stderr=subprocess.DEVNULL
        ).strip()
        git["gateway_dirty"] = bool(
            subprocess.check_output(
                ["git", "status", "--porcelain", "--", "gateway"],
                cwd=REPO,
                text=True,
                stderr=subprocess.DEVNULL,
            ).strip()
        )
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": versions,
        "git": git,
        "pinning": {k: sorted(v) for k, v in cpus.items()},
        "env_overrides": sorted(k for k in os.environ if k.startswith("LLM_GATEWAY_")),
        "loadavg_start": os.getloadavg(),
        "gateway_sources_sha1": source_fingerprint(),
    }


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Gateway vs bare FastAPI+aiohttp pass-through vs direct: "
        "req/s, latency and CPU per request.",
    )
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=1.5, help="warm-up seconds per cell")
    p.add_argument("--concurrency", default="1,64", help="comma-separated (default 1,64)")
    p.add_argument("--modes", default="nonstream,stream", help="nonstream,stream")
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated, of {','.join(TARGETS)} (default {','.join(DEFAULT_TARGETS)}; "
        "gateway-fleet starts its own redis-server)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs of every cell")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="pace each cell to this many requests/s (0: closed loop, the default)",
    )
    p.add_argument("--chunks", type=int, default=10, help="chunk events per stream")
    p.add_argument(
        "--stream-gap-ms",
        type=float,
        default=0.0,
        help="backend pause between stream events (0: one write)",
    )
    p.add_argument(
        "--idle-sample",
        type=float,
        default=2.0,
        help="seconds to measure idle CPU of the servers (0: skip)",
    )
    p.add_argument("--settle", type=float, default=0.5, help="pause between cells (s)")
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=NOISY_CORES,
        help="before each cell, wait until other processes use at most this many cores",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="longest wait for a quiet machine before a cell (s; 0: never wait)",
    )
    p.add_argument(
        "--retry-noisy",
        type=int,
        default=1,
        help="measure a cell again (up to N times) when other processes used more than "
        f"{NOISY_CORES} cores during it",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin the proxies to CPU 0, backend, load generator and Redis to the others",
    )
    p.add_argument(
        "--gateway-cmd",
        help="run this instead of 'llm-gateway serve -c {config}' ({config}: the generated "
        "config, {python}: this interpreter), e.g. to compare a patched build",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    try:
        args.concurrency_list = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error("--concurrency: comma-separated integers, e.g. 1,64")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()]
    if bad := [m for m in args.mode_list if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    if bad := [t for t in args.target_list if t not in TARGETS]:
        p.error(f"--targets: unknown {bad}; choose from {TARGETS}")
    args.target_list = [t for t in TARGETS if t in args.target_list]  # canonical order
    if not args.concurrency_list or min(args.concurrency_list) < 1:
        p.error("--concurrency: at least one value, each >= 1")
    if args.repeat < 1 or args.duration <= 0:
        p.error("--repeat >= 1 and --duration > 0")
    return args


def pinning(enabled: bool) -> dict[str, set[int]]:
    if not enabled:
        return {}
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 2:
        raise BenchError("--pin needs at least 2 CPUs")
    first, rest = {avail[0]}, set(avail[1:])
    return {"bare": first, "gateway": first, "gateway-fleet": first, "backend": rest,
            "loadgen": rest, "redis": rest}


def report(
    args: argparse.Namespace,
    meta: dict[str, Any],
    servers: Servers,
    idle: dict[str, float],
    cells: list[dict[str, Any]],
    interrupted: bool = False,
) -> None:
    """Summarise ``cells`` (all of them, or those done before an interruption), print the
    tables and write the JSON result file."""
    summary, ratios = summarise(cells, args.mode_list, args.concurrency_list, args.target_list)
    acc = acceptance(ratios)
    fratios = fleet_ratios(cells, args.mode_list, args.concurrency_list)
    facc = fleet_acceptance(fratios)
    print_tables(summary, ratios, acc, idle, args.repeat)
    print_fleet_table(fratios, facc)
    result = {
        "benchmark": "proxy_overhead",
        "meta": meta,
        "params": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "concurrency": args.concurrency_list,
            "modes": args.mode_list,
            "targets": args.target_list,
            "repeat": args.repeat,
            "chunks": args.chunks,
            "rate": args.rate,
            "stream_gap_ms": args.stream_gap_ms,
            "quiet_threshold_cores": args.quiet_threshold,
            "quiet_wait_s": args.quiet_wait,
            "retry_noisy": args.retry_noisy,
            "gateway_cmd": args.gateway_cmd,
            "pin": args.pin,
            "request_body_bytes": {m: len(request_body(m == "stream")) for m in MODES},
            "response_body_bytes": {
                "nonstream": len(completion_body()),
                "stream": len(stream_body(args.chunks)),
            },
        },
        "gateway_config": servers.gateway_config,
        "gateway_fleet_config": servers.fleet_config,
        "idle_cpu_s_per_s": idle,
        "cells": cells,
        "summary": summary,
        "ratios": ratios,
        "acceptance": acc,
        "fleet_ratios": fratios,
        "fleet_acceptance": facc,
        "interrupted": interrupted,
    }
    if interrupted:
        console.print(f"[yellow]partial results: the {len(cells)} cells done before[/yellow]")
    meta["loadavg_end"] = os.getloadavg()
    meta["gateway_sources_sha1_end"] = source_fingerprint()
    if (
        not args.gateway_cmd  # then the repo's gateway/ need not be what ran
        and meta["gateway_sources_sha1_end"] != meta["gateway_sources_sha1"]
    ):
        console.print(
            "[yellow]the gateway's sources changed during the run: the gateway process "
            "ran the version of its start; rerun to measure the new one[/yellow]"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"results: {args.out}")


def _term_handler(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _term_handler)
    # Ctrl-C must work even when started with SIGINT ignored (e.g. `cmd &` in a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logdir = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    procs = Procs(logdir)
    failed = True
    cells: list[dict[str, Any]] = []
    servers: Servers | None = None
    meta: dict[str, Any] = {}
    idle: dict[str, float] = {}
    try:
        cpus = pinning(args.pin)
        meta = run_meta(args, cpus)
        console.print(
            f"[bold]proxy overhead[/bold]: targets {','.join(args.target_list)}, modes "
            f"{args.modes}, concurrency {args.concurrency}, {args.duration:g} s cells "
            f"(+{args.warmup:g} s warm-up), repeat {args.repeat}, {os.cpu_count()} CPUs"
            + (", pinned" if cpus else "")
        )
        servers = start_servers(procs, args.target_list, args, cpus)
        console.print(
            "servers: "
            + ", ".join(f"{n} :{servers.ports[n]} (pid {p.pid})" for n, p in servers.procs.items())
        )
        smoke_check(servers, args.target_list, args.chunks)
        idle = idle_cpu(servers, args.idle_sample)
        order = list(
            cell_order(args.repeat, args.mode_list, args.concurrency_list, args.target_list)
        )
        for i, (rep, mode, c, target) in enumerate(order, 1):
            discarded: list[float] = []
            while True:
                time.sleep(args.settle)
                waited, before = (
                    wait_quiet(servers, args.quiet_threshold, args.quiet_wait)
                    if args.quiet_wait > 0
                    else (0.0, None)
                )
                if waited > 1.0:
                    console.print(
                        f"[dim]waited {waited:.0f} s for other processes to quiet down "
                        f"(now {fmt(before, '.2f')} cores)[/dim]"
                    )
                cell = run_cell(procs, servers, target, mode, c, args, cpus.get("loadgen"))
                if cell["other_cpu_cores"] <= NOISY_CORES or len(discarded) >= args.retry_noisy:
                    break
                discarded.append(cell["other_cpu_cores"])
                console.print(
                    f"[dim]{target} {mode} c={c}: other processes used "
                    f"{cell['other_cpu_cores']:.2f} cores; measuring again[/dim]"
                )
            cell["repeat"] = rep
            cell["quiet_wait_s"] = waited
            cell["discarded_noisy_other_cores"] = discarded
            cells.append(cell)
            proxy = cell["proxy_cpu_ms_per_req"]
            err = (
                f" [red]{cell['errors']} errors: {cell['error_samples'][:1]}[/red]"
                if cell["errors"]
                else ""
            )
            console.print(
                f"[{i:>2}/{len(order)}] run {rep + 1} {mode:<9} c={c:<3} {target:<13} "
                f"{cell['rps']:>7.0f} req/s  p50 {cell['latency_ms']['p50']:7.2f} ms  "
                f"p99 {cell['latency_ms']['p99']:7.2f} ms  proxy CPU "
                f"{fmt(proxy)} ms/req  other {noisy(cell['other_cpu_cores'])} cores{err}"
            )
        report(args, meta, servers, idle, cells)
        failed = any(c["errors"] for c in cells)
        return 1 if failed else 0
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping the servers[/yellow]")
        if cells and servers is not None:
            with contextlib.suppress(Exception, KeyboardInterrupt):
                report(args, meta, servers, idle, cells, interrupted=True)
        return 130
    finally:
        procs.stop_all()
        if failed:
            console.print(f"server logs kept in {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
