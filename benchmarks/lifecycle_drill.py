"""Lifecycle drill: maintenance cycles under a steady load must be invisible to clients.

Three simulated vLLM backends (in-process ``SimServerThread``s; the servers are in
``drill_servers.py``, the load and its checks in ``drill_streams.py``) serve ``m1`` behind the
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
``[DONE]``, or an error event; counted by the error event's ``code``), answers the backend
itself ended with ``finish_reason`` ``abort``, and the most backends seen out of rotation at
once (sampled every 50 ms).
Exit status 1 when the must-hold fails. Every request is greedy (``temperature`` 0) and
every stream asks ``stream_options.include_usage``, so each stream that was not cut is also
checked whole (:mod:`drill_streams`): one ``id``/``model``/``created``, one role delta, one
``finish_reason`` (``length``), one usage with the prompt tokens and ``completion_tokens ==
max_tokens``, and exactly the text an uninterrupted simulated backend generates.

Streams that break for real, and continuation before -> after (issue 17):

* ``--kill-every S``: every ``S`` seconds one backend's simulator (the one with the most
  generation requests open; ``drill_servers.Killer``) is killed abruptly mid-stream
  (``SimServerThread.kill``: listener closed, every open connection reset, as a SIGKILLed
  vLLM; no ``finish_reason``, no ``[DONE]``) and restarted on its port ``--kill-down``
  seconds later (default 3).
* ``--drain-deadline S``: the cycles' drains get an ``S``-second deadline
  (``lifecycle.drain_deadline_s``; the demo's is 10 s), so long streams are still open when
  it passes (continued on another backend, code ``drain_deadline``, or cut when not).
* ``--max-tokens N`` (default 256): requests draw ``max_tokens`` from 32..N; longer
  streams (e.g. 768: up to ~9 s) are still open when a short drain deadline passes.
* ``--max-continuations N``: ``proxy.max_continuations`` (default: the gateway's, 2; 0:
  continuation off, the gateway before issue 17).
* ``--compare``: the same seeded load and fault schedule twice, each on a fresh fleet and
  gateway: first with ``proxy.max_continuations: 0`` (before), then with the default, 2,
  or ``--max-continuations`` (after); ``--duration`` defaults to 60 s per phase. Printed
  and written to ``--out`` (a ``before`` and an ``after`` report): streams, streams cut,
  streams continued (from the gateway's ``gateway_stream_continuations_total{reason,
  outcome}`` on ``/metrics``, by outcome and by reason), the streams the gateway logged as
  continued (``[request id]`` of its ``stream continued`` log line) and, of them, those cut
  later or not whole, streams not whole among those not cut, the retries refused for want
  of retry budget (``gateway_retry_budget_exhausted_total``: a continuation refused so
  counts as ``no_backend``), and ``streams cut: X -> Y``. Exit status 1 when the after
  phase has a stream that is not whole, or cuts more than before.

Each report also has the faults (kills with their time, drain deadline) and the
``max_continuations`` it ran with. Without a fault flag the drill runs as it always did.

Usage::

    python benchmarks/lifecycle_drill.py                        # 120 s at 4 req/s
    python benchmarks/lifecycle_drill.py --duration 60 --rate 6 --medium-every 15
    python benchmarks/lifecycle_drill.py --compare --kill-every 10 --drain-deadline 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drill_servers import NAMES, ControlServer, Fleet, GatewayServer, Killer
from drill_streams import by_label, counters, run_load

from gateway.config import GatewayConfig
from gateway.demo import with_fast_cycles
from gateway.wiring import Gateway

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "lifecycle_drill.json"
COMPARE_OUT = HERE / "results" / "lifecycle_drill_compare.json"


# ---- config ---------------------------------------------------------------------------


def drill_config(
    fleet: Fleet, control_port: int, args: argparse.Namespace, max_continuations: int | None
) -> GatewayConfig:
    """The gateway config: demo fast cycles, overridden by the command line;
    ``max_continuations`` None keeps the gateway's default."""
    base = GatewayConfig.model_validate({
        "backends": [{"id": n, "url": fleet.url(n), "max_num_seqs": 16} for n in NAMES],
        "server": {"graceful_shutdown_s": 5, "log_level": "warning"},
    })
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
    if args.drain_deadline is not None:
        lc["drain_deadline_s"] = args.drain_deadline
    if max_continuations is not None:
        data["proxy"]["max_continuations"] = max_continuations
    data["calibration"]["enabled"] = True
    return GatewayConfig(**data)


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
    max_continuations: int = 0
    faults: dict[str, Any] = field(default_factory=dict)
    cycles_started: dict[str, int] = field(default_factory=dict)
    cycles_completed: dict[str, int] = field(default_factory=dict)
    longest_drain_s: float = 0.0
    drains: int = 0
    client_requests: int = 0
    streams: int = 0
    request_seconds: dict[str, float] = field(default_factory=dict)
    client_errors: int = 0
    cut_streams: int = 0
    cut_by_code: dict[str, int] = field(default_factory=dict)  # error event code (cause)
    aborted_by_backend: int = 0
    # issue 17: gateway_stream_continuations_total by outcome and by reason (the stream
    # error code), the streams the gateway logged as continued, and the text checks
    continuations: dict[str, int] = field(default_factory=dict)
    continuations_by_reason: dict[str, int] = field(default_factory=dict)
    continued_streams: int = 0
    continued_cut: int = 0  # continued, then cut (a later failure not continued)
    continued_not_whole: int = 0  # continued, not cut, and not whole
    retry_budget_exhausted: int = 0
    streams_not_whole: int = 0
    not_whole_samples: list[str] = field(default_factory=list)
    kills: list[tuple[float, str, int]] = field(default_factory=list)
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


def capture(logger_name: str, verbose: bool) -> Timeline:
    """Keep ``logger_name``'s INFO lines (out of the console unless ``verbose``; its
    warnings still reach it)."""
    timeline = Timeline()
    log = logging.getLogger(logger_name)
    log.setLevel(logging.INFO)
    log.addHandler(timeline)
    if not verbose:
        log.propagate = False
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        log.addHandler(console)
    return timeline


def uncapture(logger_name: str) -> None:
    log = logging.getLogger(logger_name)
    for h in list(log.handlers):
        log.removeHandler(h)
    log.propagate = True


CONTINUED = re.compile(r"^stream continued: .*\[request (?P<rid>[^\]]+)\]$")


def run_phase(args: argparse.Namespace, max_continuations: int | None, tag: str) -> Report:
    """One drill run on a fresh fleet and gateway (``max_continuations`` None: the gateway's
    default); the faults of ``args`` on the same schedule in every run."""
    timeline = capture("gateway.fleet", args.verbose)
    continued_log = capture("gateway.flow.continuing", args.verbose)
    fleet = Fleet()
    control = ControlServer(fleet)
    cfg = drill_config(fleet, control.port, args, max_continuations)
    gw = GatewayServer(cfg)
    g = gw.gateway
    deadline = time.monotonic() + 30
    while not all(b.routable for b in g.fleet):
        if time.monotonic() > deadline:
            raise SystemExit("backends did not become warm")
        time.sleep(0.05)
    lc = cfg.lifecycle
    faults: dict[str, Any] = {"drain_deadline_s": lc.drain_deadline_s,
                              "max_tokens": args.max_tokens, "seed": args.seed}
    if args.kill_every:
        faults.update(kill_every_s=args.kill_every, kill_down_s=args.kill_down)
    print(
        f"lifecycle drill{f' ({tag})' if tag else ''}: {len(NAMES)} simulated backends behind "
        f"{gw.url}; {args.duration:g} s at {args.rate:g} req/s; short every "
        f"{lc.short.every_s:g} s, medium every {lc.medium.every_s:g} s (rest "
        f"{lc.medium.cooldown_s:g} s), long every {lc.long.every_s:g} s; drain deadline "
        f"{lc.drain_deadline_s:g} s; max_continuations {cfg.proxy.max_continuations}"
        + (f"; a backend killed every {args.kill_every:g} s for {args.kill_down:g} s"
           if args.kill_every else ""),
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
    killer = (
        Killer(NAMES, args.kill_every, args.kill_down, fleet.kill, fleet.revive,
               fleet.open_requests)
        if args.kill_every else None
    )
    t0 = time.monotonic()
    if killer is not None:
        killer.start()
    try:
        results = asyncio.run(run_load(
            gw.url, args.duration, args.rate, args.seed, tag or "drill", args.max_tokens
        ))
    finally:
        if killer is not None:
            killer.stop()
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
        max_continuations=cfg.proxy.max_continuations,
        faults=faults,
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
    conts, rep.retry_budget_exhausted = counters(gw.url)
    rep.continuations = by_label(conts, 1)
    rep.continuations_by_reason = by_label(conts, 0)
    rep.client_requests = len(results)
    rep.streams = sum(r.stream for r in results)
    errors = [r for r in results if r.error]
    rep.client_errors = len(errors)
    rep.cut_streams = sum(r.cut for r in results)
    for r in results:
        if r.cut_code is not None:
            rep.cut_by_code[r.cut_code] = rep.cut_by_code.get(r.cut_code, 0) + 1
    rep.aborted_by_backend = sum(r.aborted for r in results)
    rep.error_samples = [f"{round(r.start - t0, 2)} s: {r.error}" for r in errors[:10]]
    continued = {m["rid"] for _, line in continued_log.lines if (m := CONTINUED.match(line))}
    rep.continued_streams = len(continued)
    rep.streams_not_whole = sum(r.not_whole is not None for r in results)
    rep.continued_cut = sum(r.request_id in continued and r.cut for r in results)
    rep.continued_not_whole = sum(
        r.request_id in continued and r.not_whole is not None for r in results
    )
    rep.not_whole_samples = [
        f"{r.request_id} ({'continued' if r.request_id in continued else 'not continued'}): "
        f"{r.not_whole}" for r in results if r.not_whole
    ][:10]
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
    rep.kills = killer.kills if killer is not None else []
    rep.sim_restarts = dict(fleet.restarts)
    rep.must_hold = (
        rep.client_errors == 0 and rep.cut_streams == 0 and rep.cycles_completed["medium"] >= 3
    )

    gw.stop()
    fleet.stop()
    control.stop()
    uncapture("gateway.fleet")
    uncapture("gateway.flow.continuing")
    return rep


def print_report(rep: Report) -> None:
    max_out = max(1, len(NAMES) // 4)
    print(
        f"cycles completed: medium {rep.cycles_completed['medium']} "
        f"(started {rep.cycles_started['medium']}), short {rep.cycles_completed['short']} "
        f"(started {rep.cycles_started['short']}), long {rep.cycles_completed['long']} "
        f"(started {rep.cycles_started['long']})"
    )
    print(f"longest drain: {rep.longest_drain_s:.3f} s over {rep.drains} drains")
    if rep.kills:
        print(f"backends killed: {len(rep.kills)} (s since start, backend, its open requests: "
              f"{rep.kills})")
    print(
        f"client requests: {rep.client_requests} ({rep.streams} streams; duration "
        f"{rep.request_seconds})"
    )
    print(f"client-visible errors: {rep.client_errors}")
    print(f"cut streams: {rep.cut_streams}"
          + (f" (by error code: {rep.cut_by_code})" if rep.cut_by_code else ""))
    print(
        f"streams continued (gateway_stream_continuations_total by outcome): "
        f"{rep.continuations or 0} (by reason: {rep.continuations_by_reason or 0}); "
        f"streams logged as continued: {rep.continued_streams}, of which cut later: "
        f"{rep.continued_cut}, not whole: {rep.continued_not_whole}"
    )
    if rep.continuations.get("continued") and not rep.continued_streams:
        print("  (no 'stream continued: ... [request id]' log line recognized: the continued "
              "streams could not be told apart; see CONTINUED)")
    print(f"retries refused for want of retry budget: {rep.retry_budget_exhausted}")
    print(f"streams not whole (not cut): {rep.streams_not_whole}")
    for line in rep.not_whole_samples:
        print(f"  not whole: {line}")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of load (default 120; 60 per phase with --compare)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--short-every", type=float, default=5.0)
    p.add_argument("--medium-every", type=float, default=20.0)
    p.add_argument("--cooldown", type=float, default=4.0, help="medium cycle rest, seconds")
    p.add_argument("--long-every", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-every", type=float, default=None,
                   help="kill the busiest backend abruptly every S seconds")
    p.add_argument("--kill-down", type=float, default=3.0,
                   help="seconds a killed backend stays down before its restart")
    p.add_argument("--drain-deadline", type=float, default=None,
                   help="the drains' deadline, seconds (default: the demo's 10)")
    p.add_argument("--max-continuations", type=int, default=None,
                   help="proxy.max_continuations (default: the gateway's, 2)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="longest request, tokens (each draws 32..N; ~0.012 s a token)")
    p.add_argument("--compare", action="store_true",
                   help="run twice: max_continuations 0 (before), then the default (after)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON report (default {DEFAULT_OUT.name}; {COMPARE_OUT.name} with "
                   "--compare, in benchmarks/results)")
    p.add_argument("--verbose", action="store_true", help="log every transition")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = 60.0 if args.compare else 120.0
    if args.out is None:
        args.out = COMPARE_OUT if args.compare else DEFAULT_OUT
    if args.max_tokens < 32:
        p.error("--max-tokens must be at least 32")
    if args.kill_every is not None and not 0 < args.kill_down < args.kill_every:
        p.error("--kill-down must be more than 0 and less than --kill-every")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    if args.compare:
        before = run_phase(args, 0, "before")
        print_report(before)
        after = run_phase(args, args.max_continuations, "after")
        print_report(after)
        line = f"streams cut: {before.cut_streams} -> {after.cut_streams}"
        print(
            f"{line} (of {before.streams} / {after.streams} streams; by error code "
            f"{before.cut_by_code} -> {after.cut_by_code}; continued "
            f"{before.continuations.get('continued', 0)} -> "
            f"{after.continuations.get('continued', 0)}; not whole "
            f"{before.streams_not_whole} -> {after.streams_not_whole})"
        )
        args.out.write_text(
            json.dumps({"before": asdict(before), "after": asdict(after), "summary": line},
                       indent=2) + "\n"
        )
        print(f"written: {args.out}")
        ok = after.streams_not_whole == 0 and after.cut_streams <= before.cut_streams
        return 0 if ok else 1

    rep = run_phase(args, args.max_continuations, "")
    print_report(rep)
    print(
        f"must hold (0 errors, 0 cut streams, >= 3 medium cycles): "
        f"{'PASS' if rep.must_hold else 'FAIL'}"
    )
    args.out.write_text(json.dumps(asdict(rep), indent=2) + "\n")
    print(f"written: {args.out}")
    return 0 if rep.must_hold else 1


if __name__ == "__main__":
    sys.exit(main())
