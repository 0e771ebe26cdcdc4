"""The kill drill on REAL vLLM (issue 17): ``python benchmarks/real_vllm.py continuation``
(or this file directly), from the repo root, project venv.

Two vLLM CPU servers of the recipe's tiny random-weight model (``scripts/vllm-cpu``): ``a``
and a victim (``--max-num-seqs`` the drill's stream count, ``--stream-interval``
``--stream-interval``, default 2; its engine core a process of its own, stopped while
the requests arrive so that all start in the same step), and the gateway in process
(``tests/support/servers.py`` ``GatewayThread``) with the victim as primary and ``a`` as
standby, so every first attempt goes to the victim and every continuation to ``a``. Each
round: ``--streams`` chat and as many completions streams (temperature 0, a seed each,
``ignore_eos``, ``--max-tokens``), answered first by ``a`` (the reference) and by the
victim (the control), then through the gateway with the ``openai`` SDK; the victim's
process group is SIGKILLed once every stream has ``--min-tokens`` tokens and none has
finished (``tests/support/continuation_drill.py``, the same drill as
``tests/realvllm/test_continuation_real_vllm.py``); the next round boots a new victim.

Prints per round and in total: streams, continued (``gateway_stream_continuations_total``
by outcome), cut (streams whose client saw an error or no ``[DONE]``), completions and chat
exact share (text equal to ``a``'s), streams whose prompt text came back (vLLM's
detokenizer bug vllm-project/vllm#48853, the known cause of completions differences), usage
right, and the control (victim uninterrupted vs ``a``). ``--default-budget`` keeps the
gateway's default retry budget (otherwise its floor is raised to 10/s so that every stream
may be continued). JSON to ``--json`` (default
``benchmarks/results/real_vllm_continuation.json``). Exit status 0 when every stream ended
whole with usage right and every completions difference is explained by the vLLM bug, 1
otherwise, 2 without the vLLM venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.continuation_check import (  # noqa: E402
    continuation_counts,
    first_difference,
    leaked_streams,
    summarize,
    whole,
)
from tests.support.continuation_drill import (  # noqa: E402
    LAST_MISSED,
    StreamResult,
    engine_freeze,
    engine_gate,
    kill_drill,
    make_requests,
    run_streams,
)
from tests.support.servers import GatewayThread, gateway_config  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    VLLM_VERSION,
    VllmServer,
    default_vllm_venv,
    ensure_tiny_model,
    start_all,
    vllm_unavailable_reason,
)


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32, help="chat streams, and as many "
                   "completions streams, per round (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--min-tokens", type=int, default=2,
                   help="tokens every stream has when the victim is killed")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stream-interval", type=int, default=2, help="the victim's vLLM "
                   "--stream-interval (tokens per event)")
    p.add_argument("--default-budget", action="store_true",
                   help="keep the gateway's default retry budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path,
                   default=REPO / "benchmarks" / "results" / "real_vllm_continuation.json")
    return p


def _diff(r: StreamResult, ref: StreamResult) -> dict[str, Any]:
    """Where ``r``'s text leaves the reference's, with 40 characters either side, and the
    prompt's ids (for ``/detokenize``)."""
    i = first_difference(r.text, ref.text)
    return {"at": i, "got": r.text[max(0, i - 40):i + 80], "want": ref.text[max(0, i - 40):i + 80],
            "got_len": len(r.text), "want_len": len(ref.text), "prompt_ids": r.prompt_ids}


def one_round(a: VllmServer, victim: VllmServer, args: argparse.Namespace, seed: int
              ) -> dict[str, Any]:
    """One drill against a booted ``victim`` (killed by it); its figures."""
    requests = make_requests(args.streams, args.streams, args.max_tokens, seed)
    refs, _ = asyncio.run(run_streams(a.url, requests))
    control, _ = asyncio.run(run_streams(victim.url, requests))
    retry = {} if args.default_budget else {"retry": {"budget_min_per_s": 10.0}}
    cfg = gateway_config(
        [{"id": "victim", "url": victim.url, "max_num_seqs": 2 * args.streams},
         {"id": "a", "url": a.url, "max_num_seqs": 16, "role": "standby"}], **retry)
    gw = GatewayThread(cfg)
    gw.start()
    try:
        gw.wait_ready(timeout=30, routable=2)
        t0 = time.monotonic()
        results, killed, missed = asyncio.run(
            kill_drill(gw.url, requests, victim.kill, args.min_tokens, gate=engine_gate(
                victim, lambda: gw.gateway.fleet.get("victim").in_flight),
                upstream_open=lambda: gw.gateway.fleet.get("victim").in_flight,
                freeze=engine_freeze(victim)))
        continued = continuation_counts(gw.gateway.metrics)
    finally:
        gw.stop()
    s, c = summarize(results, refs), summarize(control, refs)
    by_key = {r.request.key: r for r in refs}
    leaked = leaked_streams(a.url, results, refs)
    firsts = [r.first_at for r in results if r.first_at is not None]
    ends = [r.done_at for r in results if r.done_at is not None]
    return {
        "killed": killed is not None,
        "batches_sent_again": missed,
        "kill_after_s": None if killed is None else round(killed - t0, 3),
        "window_s": round(min(ends) - max(firsts), 3) if firsts and ends else None,
        "missed": None if killed is not None else list(LAST_MISSED),
        "streams": len(results),
        "continuations": continued,
        "cut": sum(not whole(r) for r in results),
        "whole": s.whole,
        "usage_right": s.usage_right,
        "exact": s.exact,
        "by_kind": s.streams,
        "chat_exact_share": round(s.share("chat"), 3),
        "completions_exact_share": round(s.share("completions"), 3),
        "mismatched": s.mismatched,
        "prompt_leaked": leaked,
        "diffs": {r.request.key: _diff(r, by_key[r.request.key]) for r in results
                  if r.request.key in s.mismatched},
        "control_mismatched": c.mismatched,
        "first_token_s": {r.request.key: None if r.first_at is None else round(r.first_at - t0, 3)
                          for r in results},
        "done_s": {r.request.key: None if r.done_at is None else round(r.done_at - t0, 3)
                   for r in results},
    }


def print_round(i: int, r: dict[str, Any]) -> None:
    """One line per round."""
    if not r["killed"]:
        print(f"round {i}: the victim was not killed (a stream finished first): {r['missed']}")
        return
    print(f"round {i}: streams {r['streams']}, killed after {r['kill_after_s']} s, "
          f"continuations {r['continuations']}, cut {r['cut']}, "
          f"completions exact {r['completions_exact_share']:.3f}, "
          f"chat exact {r['chat_exact_share']:.3f}, usage right "
          f"{r['usage_right']}/{r['streams']}, prompt text streamed back (vllm#48853) "
          f"{len(r['prompt_leaked'])}, control differs {len(r['control_mismatched'])}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; print and write the figures (module docstring)."""
    args = build_parser().parse_args(argv)
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        print(f"real vLLM unavailable: {reason}")
        return 2
    print(f"# {' '.join(sys.argv)}\n# vLLM {VLLM_VERSION} (CPU), {platform.machine()}, "
          f"python {platform.python_version()}", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="real-vllm-continuation-"))
    model = ensure_tiny_model(venv)
    victim_args = ["--max-num-seqs", str(2 * args.streams),
                   "--stream-interval", str(args.stream_interval)]
    a = VllmServer(venv, model, log_path=logs / "a.log")
    rounds: list[dict[str, Any]] = []
    try:
        victim = VllmServer(venv, model, log_path=logs / "victim-0.log", extra_args=victim_args,
                            fast=False)
        start_all([a, victim])
        for i in range(args.rounds):
            if i:
                victim = VllmServer(venv, model, log_path=logs / f"victim-{i}.log",
                                    extra_args=victim_args, fast=False).start()
            try:
                rounds.append(one_round(a, victim, args, args.seed + i))
            finally:
                victim.stop()
            print_round(i, rounds[-1])
    finally:
        a.stop()
    done = [r for r in rounds if r["killed"]]
    total = {
        "rounds": len(rounds), "killed": len(done),
        "streams": sum(r["streams"] for r in done),
        "continued": sum(r["continuations"].get("continued", 0) for r in done),
        "cut": sum(r["cut"] for r in done),
        "usage_right": sum(r["usage_right"] for r in done),
        "completions_exact": sum(r["exact"].get("completions", 0) for r in done),
        "completions": sum(r["by_kind"].get("completions", 0) for r in done),
        "chat_exact": sum(r["exact"].get("chat", 0) for r in done),
        "chat": sum(r["by_kind"].get("chat", 0) for r in done),
        "prompt_leaked": sum(len(r["prompt_leaked"]) for r in done),
        "control_differs": sum(len(r["control_mismatched"]) for r in done),
    }
    print(f"\ntotal: streams {total['streams']} in {total['killed']} kills, continued "
          f"{total['continued']:.0f}, cut {total['cut']}, completions exact "
          f"{total['completions_exact']}/{total['completions']}, chat exact "
          f"{total['chat_exact']}/{total['chat']}, usage right "
          f"{total['usage_right']}/{total['streams']}, prompt text streamed back "
          f"(vllm#48853) {total['prompt_leaked']}, control differs {total['control_differs']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                     "rounds": rounds, "total": total}, indent=2))
    print(f"results: {args.json}")
    explained = all(set(r["mismatched"]) <= set(r["prompt_leaked"]) | {
        k for k in r["mismatched"] if k.startswith("chat")} for r in done)
    ok = bool(done) and total["cut"] == 0 and total["usage_right"] == total["streams"]
    return 0 if ok and explained else 1


if __name__ == "__main__":
    raise SystemExit(main())
