#!/usr/bin/env python3
"""Quick self-check of the real CPU vLLM: start one server through tests/support/vllm.py,
exercise the endpoints the gateway relies on, stop it.

Run with any python that has httpx, from anywhere:
    python scripts/vllm-cpu/smoke.py [--venv DIR] [--model-dir DIR] [--no-fast] [--api-key K]
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.vllm import (
    VllmServer,
    default_tiny_model_dir,
    default_vllm_venv,
    ensure_tiny_model,
    vllm_unavailable_reason,
)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=default_vllm_venv())
    ap.add_argument("--model-dir", type=Path, default=default_tiny_model_dir())
    ap.add_argument("--no-fast", action="store_true", help="3-process server (FAST=0)")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()

    reason = vllm_unavailable_reason(args.venv)
    if reason:
        print(f"SKIP: {reason}")
        return 2
    t = time.monotonic()
    model = ensure_tiny_model(args.venv, args.model_dir)
    print(f"model: {model} ({time.monotonic() - t:.1f} s)")

    server = VllmServer(args.venv, model, fast=not args.no_fast, api_key=args.api_key)
    server.start()
    print(
        f"server: {server.url} pid {server.pid} ready after {server.ready_after_s:.1f} s, "
        f"rss {server.rss_bytes() / 2**20:.0f} MiB, log {server.log_path}"
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        if args.api_key:
            r = httpx.get(server.url + "/v1/models", timeout=10)
            print(f"GET /v1/models without the key -> {r.status_code} {r.text.strip()[:60]}")
            check(r.status_code == 401, "api key enforced")
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
            r = c.get("/v1/models")
            r.raise_for_status()
            ids = [m["id"] for m in r.json()["data"]]
            print(f"GET /v1/models -> {ids}")
            check(ids == ["tiny-llama"], "model list")

            body = {
                "model": "tiny-llama",
                "max_tokens": 16,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Say hello to the gateway."}],
            }
            t = time.monotonic()
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            j = r.json()
            print(
                f"POST /v1/chat/completions -> {(time.monotonic() - t) * 1000:.0f} ms, "
                f"finish_reason={j['choices'][0]['finish_reason']} usage={j['usage']} "
                f"text={j['choices'][0]['message']['content'][:40]!r}"
            )
            check(j["usage"]["completion_tokens"] == 16, "non-stream completion_tokens == 16")

            t = time.monotonic()
            first = None
            chunks = 0
            usage = None
            finish = None
            done = False
            with c.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    **body,
                    "max_tokens": 32,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ) as s:
                s.raise_for_status()
                for line in s.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if first is None:
                        first = time.monotonic() - t
                    chunks += 1
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices", []):
                        finish = ch.get("finish_reason") or finish
            print(
                f"stream -> {chunks} chunks, first after {first * 1000:.0f} ms, total "
                f"{(time.monotonic() - t) * 1000:.0f} ms, finish_reason={finish}, "
                f"usage={usage}, [DONE]={done}"
            )
            check(
                done and usage is not None and usage["completion_tokens"] == 32,
                "stream usage/[DONE]",
            )

            r = c.get("/metrics")
            r.raise_for_status()
            gauges = sorted(
                {
                    line.split()[2]
                    for line in r.text.splitlines()
                    if line.startswith("# TYPE vllm:")
                    and line.split()[3] == "gauge"
                    and not line.split()[2].endswith("_created")
                }
            )
            print(f"GET /metrics -> {len(r.text)} bytes; vllm gauges: {', '.join(gauges)}")
            check("vllm:num_requests_running" in gauges, "num_requests_running gauge")

            r = c.post("/reset_prefix_cache")
            print(f"POST /reset_prefix_cache -> {r.status_code} {r.text.strip()[:80]}")
            check(r.status_code == 200, "reset_prefix_cache")
    finally:
        t = time.monotonic()
        server.stop()
        print(f"stopped in {time.monotonic() - t:.1f} s")
    print("SMOKE OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
